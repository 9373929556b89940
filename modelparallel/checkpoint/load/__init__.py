"""The load side, all or nothing: a partial checkpoint (``partial_load``, its parts as DCP state
dicts in ``parts`` and the optimizer's in ``optim_part``) and full weights (``full_load``), read
verified (``fastread``) into staging copies (``staging``) or through an undo journal when a copy
would not fit (``journal``); a resume waiting for its model and optimizer (``pending``)."""
