"""Full checkpoints (partial=False): not written yet."""


def save(path, tag, model, user_content, translate_if_full):
    raise NotImplementedError("full checkpoints (save_checkpoint(partial=False)) are not implemented yet")


def resume(path, directory, strict, translate_function):
    raise NotImplementedError("loading full checkpoints (resume_from_checkpoint(partial=False)) is not implemented yet")
