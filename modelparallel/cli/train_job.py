"""The body of ``modelparallel train`` on one rank: data, model, loop, validation, sample, artifacts.

Every function here is called on every rank in the same order, because the forward pass and
``generate`` run collectives; only printing and file writing are rank 0's.
"""

from __future__ import annotations

import argparse
import math
import platform
import time

import torch
import torch.distributed as dist

import modelparallel as smp

from .. import runtime
from . import checks, launch, outcome, plot, resume
from .data import WindowSampler, eval_batches, read_corpus, select_files, split_holdout
from .progress import progress
from .presets import build_distributed, load_tokenizer


def load_data(args: argparse.Namespace, tokenizer) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train tokens, validation tokens, corpus facts). Same on every rank: same files, order, cut."""
    files = select_files(args.data_files, args.max_files)
    tokens, n_read = read_corpus(files, tokenizer, int(args.max_bytes) or None)
    train, val = split_holdout(tokens, args.val_fraction, min_val=args.seq_len + 1)
    info = {"files_found": len(args.data_files), "files_read": n_read, "train_tokens": len(train),
            "val_tokens": len(val), "tokenizer": type(tokenizer).__name__}
    return train, val, info


def count_parameters(model) -> int:
    """Parameters of the whole model: a DTensor's numel is its global size; each pipeline stage
    counts its own (a weight tied across stages on its first stage only)."""
    stage = getattr(model.module, "_mp_stage", None)
    ties = stage.ties if stage is not None else {}
    local = sum(p.numel() for n, p in model.module.named_parameters() if n not in ties)
    if stage is None:
        return local
    total = torch.tensor([float(local)], dtype=torch.float64, device=runtime.current().device)
    dist.all_reduce(total, group=smp.get_pp_process_group())
    return int(total.item())


def make_optimizer(model, args):
    """AdamW over the sharded parameters, wrapped in ``smp.DistributedOptimizer`` as SageMaker
    scripts do (it is a plain step in fp32; the wrapper is where loss scaling would live)."""
    inner = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    if getattr(args, "dtype", "fp32") == "fp16":
        return smp.DistributedOptimizer(inner, static_loss_scale=None, dynamic_loss_scale=True,
                                        dynamic_loss_args={"init_scale": 2.0 ** 16, "scale_window": 200})
    return smp.DistributedOptimizer(inner)


def lr_at(step: int, args) -> float:
    """Linear warm-up, then cosine decay to a tenth of the peak: the usual schedule for short
    runs, where a constant rate leaves the loss stuck at the noise floor of its step size."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _replicas():
    """(process group, size) of the data x context ranks: TP ranks of one replica already agree,
    context ranks each hold a share of the loss."""
    return runtime.current().group(runtime.DP_CP_GROUP), smp.rdp_size() * smp.cp_size()


def dp_mean(values: list[float]) -> list[float]:
    """The mean over data-parallel replicas (and context ranks: the mean of their loss shares is
    the replica's loss)."""
    group, size = _replicas()
    if size == 1:
        return values
    t = torch.tensor(values, dtype=torch.float64, device=runtime.current().device)
    dist.all_reduce(t, group=group)
    return (t / size).tolist()


def _cp_part(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """This context-parallel rank's part of input windows and their targets (all of it at --cp 1),
    on the rank's device (the sampler cuts windows from the corpus in host memory)."""
    device = runtime.current().device
    x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
    return smp.get_batch_for_cp_rank((x, y)) if smp.cp_size() > 1 else (x, y)


@smp.step
def train_step(model, x, y):
    """One step's forward and backward, run per microbatch (through the stages at --pp > 1)."""
    loss = model(x, labels=x, shift_labels=y).loss
    model.backward(loss)
    return loss


@smp.step
def eval_step(model, x, y):
    return model(x, labels=x, shift_labels=y).loss


@torch.no_grad()
def evaluate(model, val_tokens: torch.Tensor, args) -> float:
    """Mean loss per token over the first ``--eval-windows`` held-out sequences (a batch's
    rows beyond a multiple of ``--microbatches`` are left out: each microbatch has as many)."""
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=runtime.current().device)
    windows = min((len(val_tokens) - 1) // args.seq_len, args.eval_windows)
    if smp.state.ep_size > 1:  # every rank of an expert-parallel group runs the same number of forwards
        windows -= windows % smp.rdp_size()
    for x, y in eval_batches(val_tokens, args.seq_len, args.batch_size, windows,
                             smp.rdp_rank(), smp.rdp_size()):
        x, y = _cp_part(x, y)  # under --cp a rank's loss is its share: share x its tokens = its sum
        rows = x.shape[0] - x.shape[0] % args.microbatches
        if rows:
            loss = eval_step(model, x[:rows], y[:rows]).reduce_mean()
            total += torch.tensor([loss.item() * y[:rows].numel(), y[:rows].numel()], device=total.device)
    group, size = _replicas()
    if size > 1:
        dist.all_reduce(total, group=group)
    model.train()
    return (total[0] / total[1]).item()


HISTORY_KEYS = ("loss", "lr", "step_time_s", "tokens_per_s", "val")
"""Per-step records kept in every checkpoint's user content (plain numbers and lists), so the
metrics and the plot of a resumed run cover the whole run, not just the steps since the resume."""


def train_loop(model, opt, sampler, val_tokens, args, hist: dict) -> dict:
    """Run steps ``args.start_step .. --steps``, appending to ``hist``; returns this session's
    step count and summed step time. Progress on rank 0 only (a bar on a terminal, a line every
    few seconds in a log: ``progress``); its tokens/s is the session's tokens over the session's
    step time (forward, backward, optimizer), as in the summary."""
    tokens_per_step = args.batch_size * args.seq_len * smp.rdp_size()
    session = {"steps": 0, "step_time_s": 0.0}
    bar = progress(args.steps, args.start_step, "train", disable=smp.rank() != 0)
    outcome.PROGRESS.stage = "training"
    outcome.at_step(args.start_step)
    model.train()
    for step in range(args.start_step, args.steps):
        start = time.perf_counter()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        x, y = _cp_part(*sampler.next_batch())
        loss = train_step(model, x, y).reduce_mean()
        opt.step()
        opt.zero_grad()
        (loss_value,) = dp_mean([loss.item()])
        checks.finite_loss(loss_value, step + 1, lr_at(step, args))
        elapsed = time.perf_counter() - start
        outcome.at_step(step + 1)
        session["steps"] += 1
        session["step_time_s"] += elapsed
        hist["loss"].append(loss_value)
        hist["lr"].append(opt.param_groups[0]["lr"])
        hist["step_time_s"].append(elapsed)
        hist["tokens_per_s"].append(tokens_per_step / elapsed)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            hist["val"].append([step + 1, evaluate(model, val_tokens, args)])
        bar.set_postfix(loss=f"{loss_value:.3f}",
                        tok_s=f"{tokens_per_step * session['steps'] / session['step_time_s']:,.0f}", refresh=False)
        bar.update()
        if args.save_every and (step + 1) % args.save_every == 0:
            save(args, step + 1, hist, bar)
    smp.wait_for_checkpoints()  # the last checkpoint is committed before the run goes on
    bar.close()
    return session


def save(args, step: int, hist: dict, bar) -> None:
    """A partial checkpoint of step ``step`` with the history so far; one line on rank 0. By
    default asynchronous: training waits only for the copy to host memory (and for the previous
    save, if it is still being written); ``--sync-save`` writes it before going on."""
    start = time.perf_counter()
    directory = resume.checkpoint_dir(args.out)
    sync = getattr(args, "sync_save", True)
    smp.save_checkpoint(directory, tag=resume.step_tag(step), user_content={"step": step, "history": hist},
                        num_kept_partial_checkpoints=args.keep, async_save=not sync)
    if smp.rank() == 0:
        took = time.perf_counter() - start
        how = f"{took:.1f} s" if sync else f"staged in {took:.1f} s, written in the background"
        bar.write(f"step {step}: saved checkpoint {directory / (resume.step_tag(step) + resume.PARTIAL)} ({how})")


def resume_run(args, sampler) -> tuple[int, dict]:
    """(step to continue from, history so far). Loads ``args.resume_tag`` (model, optimizer,
    loss scale) if the launcher chose one, and skips the batches already trained on."""
    empty = {k: [] for k in HISTORY_KEYS}
    if args.resume_tag is None:
        return 0, empty
    outcome.PROGRESS.stage = "resume"
    directory = resume.checkpoint_dir(args.out)
    content = smp.resume_from_checkpoint(directory, tag=args.resume_tag)
    step = resume.saved_step(content, args.resume_tag, directory / (args.resume_tag + resume.PARTIAL))
    if step >= args.steps:
        raise ValueError(f"{directory}/{args.resume_tag} is at step {step}, already --steps {args.steps}: "
                         "nothing to resume")
    sampler.skip(step)
    saved = content.get("history") or {}
    hist = {k: list(saved.get(k, [])) for k in HISTORY_KEYS}
    hist["val"] = [list(v) for v in hist["val"]]
    if smp.rank() == 0:
        print(f"resumed from {directory / (args.resume_tag + resume.PARTIAL)} at step {step}", flush=True)
    return step, hist


def generate_sample(model, tokenizer, args) -> str:
    """Text continued from ``--prompt``. Runs on every rank (generate runs collectives); the
    sampling seed is reset identically on all ranks so they pick the same tokens."""
    if args.sample_tokens == 0 or smp.pp_size() > 1:  # generate runs the whole model in one process
        return ""
    if smp.cp_size() > 1:
        return "(no sample: generation is not context parallel; train with --cp 1 to sample)"
    ids = torch.tensor([tokenizer.encode(args.prompt, add_special_tokens=False)], dtype=torch.long,
                       device=runtime.current().device)
    sampling = {"do_sample": True, "temperature": args.temperature, "top_k": 40} if args.temperature > 0 \
        else {"do_sample": False}
    eos = getattr(tokenizer, "eos_token_id", None)
    if smp.state.ep_size > 1:  # no rank may stop early: its expert-parallel group would wait for it
        sampling["min_new_tokens"] = args.sample_tokens
    torch.manual_seed(args.seed)
    model.eval()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.sample_tokens,
                             pad_token_id=eos, eos_token_id=eos, **sampling)
    model.train()
    return tokenizer.decode(out[0].tolist())


def _summary(args, hist, info, val_loss, sample, times: dict, session: dict, n_params, opt) -> dict:
    last = hist["loss"][-min(10, len(hist["loss"])):]
    tokens_per_step = args.batch_size * args.seq_len * smp.rdp_size()
    return {
        "config": {k: (str(v) if k in ("out",) else v) for k, v in vars(args).items()
                   if not k.startswith("_") and k not in ("argv", "data_files")},
        "world_size": smp.size(), "device": runtime.current().device.type,
        "tp": smp.tp_size(), "pp": smp.pp_size(), "cp": smp.cp_size(),
        "dp": smp.rdp_size(), "ep": smp.state.ep_size,
        "threads_per_rank": torch.get_num_threads(), "optimizer": type(opt).__name__,
        "parameters": n_params, "corpus": info, **hist,
        # the history starts later than step 0 only if resumed from a checkpoint that did not keep it
        "history_first_step": args.start_step - (len(hist["loss"]) - session["steps"]),
        "initial_train_loss": hist["loss"][0], "final_train_loss": sum(last) / len(last),
        "final_val_loss": val_loss, "first_step": args.start_step,
        # this session's tokens over its summed step time: the progress bar's last tokens/s
        "mean_tokens_per_s": tokens_per_step * session["steps"] / session["step_time_s"],
        **times, "sample": sample,
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
    }


def _report(args, m: dict) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    plot.write_metrics(args.out, m)
    layout = f"tp {m['tp']}" + "".join(f" x {k} {m[k]}" for k in ("pp", "cp", "ep") if m[k] > 1) + f" x dp {m['dp']}"
    plot.plot_loss(args.out, m["loss"], m["val"] + [[args.steps, m["final_val_loss"]]],
                   f"{args.model}: {layout}, {m['parameters'] / 1e6:.2f}M params",
                   first_step=m["history_first_step"])
    resumed = f"; resumed at step {m['first_step']}" if m["first_step"] else ""
    print(f"\ntrain loss {m['initial_train_loss']:.3f} -> {m['final_train_loss']:.3f} (mean of last steps), "
          f"validation loss {m['final_val_loss']:.3f}\n{m['mean_tokens_per_s']:,.0f} tokens/s (step time only, "
          f"as in the progress bar{resumed})\nset-up {m['setup_time_s']:.0f} s (launch, imports, data, model), "
          f"training {m['train_time_s']:.0f} s (with validation and checkpoints), total {m['wall_time_s']:.0f} s")
    if m["sample"]:
        print(f"sample from {args.prompt!r}:\n{'-' * 60}\n{m['sample']}\n{'-' * 60}")
    print(f"wrote {args.out / 'metrics.json'} and {args.out / 'loss.png'}", flush=True)


def run_job(args: argparse.Namespace) -> int:
    """Train on this rank; rank 0 writes the artifacts and prints the summary."""
    dtype = getattr(args, "dtype", "fp32")
    # the TP ranks of a replica draw the same windows: SageMaker's prescaled-batch layout
    smp.init({"tensor_parallel_degree": args.tp, "pipeline_parallel_degree": args.pp,
              "context_parallel_degree": args.cp, "expert_parallel_degree": getattr(args, "ep", 1),
              "microbatches": args.microbatches, "random_seed": args.seed, "prescaled_batch": True,
              "fp16": dtype == "fp16", "bf16": dtype == "bf16"})
    tokenizer = load_tokenizer(args.model)
    train_tokens, val_tokens, info = load_data(args, tokenizer)
    model = build_distributed(args.model, args.seq_len, args.seed)
    n_params = count_parameters(model)
    opt = make_optimizer(model, args)
    sampler = WindowSampler(train_tokens, args.seq_len, args.batch_size, args.seed, smp.rdp_rank(), smp.rdp_size())
    args.start_step, hist = resume_run(args, sampler)
    setup = time.time() - launch.start_time()
    t_train = time.perf_counter()
    session = train_loop(model, opt, sampler, val_tokens, args, hist)
    train_time = time.perf_counter() - t_train
    outcome.PROGRESS.stage = "final validation and sample"
    val_loss = evaluate(model, val_tokens, args)
    sample = generate_sample(model, tokenizer, args)
    if smp.rank() == 0:
        times = {"setup_time_s": setup, "train_time_s": train_time, "wall_time_s": time.time() - launch.start_time()}
        _report(args, _summary(args, hist, info, val_loss, sample, times, session, n_params, opt))
    dist.barrier()
    dist.destroy_process_group()
    return 0
