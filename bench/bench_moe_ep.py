"""Expert parallelism on CPU: a small Mixtral whose experts dominate, E=1 against E=2 on 2 ranks.

Both runs use the same 2 ranks with one thread each and the same data: each rank brings its own
batch (data parallelism). At E=1 every rank holds all experts (plain data parallelism); at E=2
each holds half of every layer's experts and tokens travel to them by all-to-all (dropless).
One step = forward + backward + AdamW (``DistributedModel`` + ``DistributedOptimizer``).

Measured per run: tokens/s (both ranks' tokens over the slowest rank's median step), parameter
bytes per rank (experts and the rest; the goal at E=2 is the expert bytes / 2), the all-to-all
payload of one training step per MoE layer and rank against the theory (forward: tokens x top_k
rows of hidden values sent out and as many back, 2 x tokens x top_k x hidden x dtype bytes, of
which (E - 1) / E leave the rank when routing is balanced; the backward moves the same again), and
the share of the step spent inside the all-to-alls (waiting for the slower rank included).

Both runs are repeated ``--repeats`` times; ``spread`` gives min / median / max over the repeats
of the tokens/s ratio and the all-to-all share, the other fields are the last repeat's.

Usage: ``python bench/bench_moe_ep.py [--steps 5] [--warmup 2] [--repeats 3] [--quick]``; writes
``bench/results/moe_ep.json`` (``BENCH_RESULTS_DIR`` to write elsewhere).
"""

from __future__ import annotations

import argparse
import statistics
import time

import common

SHAPE = dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, vocab_size=1024,
             max_position_embeddings=512)
QUICK = dict(SHAPE, hidden_size=64, intermediate_size=256, vocab_size=256)
BATCH, SEQ, LR, SEED = 4, 256, 1e-4, 0


def build(shape: dict):
    import torch
    from transformers import MixtralConfig, MixtralForCausalLM

    torch.manual_seed(SEED)
    config = MixtralConfig(**shape)
    config._experts_implementation = "eager"  # what the E=2 dispatch computes per expert, for a like-for-like run
    return MixtralForCausalLM(config)


class AllToAllMeter:
    """Bytes sent and seconds spent in ``dist.all_to_all_single`` (the token rows; the small
    per-expert count exchange is counted apart), by phase."""

    def __init__(self):
        import torch
        import torch.distributed as dist

        self.dist, self.torch = dist, torch
        self.original = dist.all_to_all_single
        self.phase, self.bytes, self.seconds, self.remote, self.calls = "forward", {}, 0.0, {}, 0
        dist.all_to_all_single = self._measured

    def _measured(self, output, input, output_split_sizes=None, input_split_sizes=None, group=None, **kw):
        start = time.perf_counter()
        out = self.original(output, input, output_split_sizes=output_split_sizes,
                            input_split_sizes=input_split_sizes, group=group, **kw)
        self.seconds += time.perf_counter() - start
        if input.is_floating_point():
            row = input[0].numel() * input.element_size() if input.shape[0] else 0
            me = self.dist.get_rank(group)
            sent = sum(input_split_sizes) * row
            self.bytes[self.phase] = self.bytes.get(self.phase, 0) + sent
            self.remote[self.phase] = self.remote.get(self.phase, 0) + sent - input_split_sizes[me] * row
            self.calls += 1
        return out

    def close(self):
        self.dist.all_to_all_single = self.original


def run(ep: int, shape: dict, warmup: int, steps: int) -> dict:
    import torch

    import modelparallel as smp
    from modelparallel.expert import is_expert_parameter
    from modelparallel.tp.layout import local_part

    common.one_thread()
    base = common.baseline_mb()
    smp.init({"expert_parallel_degree": ep, "prescaled_batch": True, "random_seed": SEED})
    model = smp.DistributedModel(build(shape))
    opt = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=LR))
    g = torch.Generator().manual_seed(SEED + smp.rank())
    x = torch.randint(0, shape["vocab_size"], (BATCH, SEQ), generator=g)
    params = list(model.parameters())
    expert_bytes = sum(local_part(p).numel() * p.element_size() for p in params if is_expert_parameter(p)
                       or p.dim() == 3)
    other_bytes = sum(local_part(p).numel() * p.element_size() for p in params) - expert_bytes
    meter = AllToAllMeter()
    times, comm, loss0 = [], [], None
    for i in range(warmup + steps):
        torch.distributed.barrier()
        meter.seconds, meter.bytes, meter.remote, meter.phase = 0.0, {}, {}, "forward"
        start = time.perf_counter()
        loss = model(x, labels=x).loss
        meter.phase = "backward"
        model.backward(loss)
        opt.step()
        opt.zero_grad()
        elapsed = time.perf_counter() - start
        loss0 = loss.item() if loss0 is None else loss0
        if i >= warmup:
            times.append(elapsed)
            comm.append(meter.seconds)
    meter.close()
    slow = common.slowest(times)
    layers = shape["num_hidden_layers"]
    return {"ep": ep, "step_s": slow, "median_step_s": statistics.median(slow), "first_loss": loss0,
            "tokens_per_step": BATCH * SEQ * smp.size(), "expert_param_bytes": expert_bytes,
            "other_param_bytes": other_bytes, "all_to_all_s": comm,
            "all_to_all_share": statistics.median(c / t for c, t in zip(comm, times)),
            "all_to_all_bytes_per_layer": {k: v / layers for k, v in meter.bytes.items()},
            "remote_bytes_per_layer": {k: v / layers for k, v in meter.remote.items()},
            "peak_rss_mb": common.peak_above_baseline_mb(base, model), "load_average": common.load_average()}


def theory_bytes(shape: dict) -> int:
    """Forward all-to-all bytes per MoE layer and rank: every (token, expert) row out and back."""
    return 2 * BATCH * SEQ * shape["num_experts_per_tok"] * shape["hidden_size"] * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="a smaller model, for trying the script")
    args = parser.parse_args()
    shape = QUICK if args.quick else SHAPE
    repeats = []
    for r in range(args.repeats):
        runs = {}
        for ep in (1, 2):
            print(f"repeat {r + 1}/{args.repeats}, E={ep}: 2 ranks, one thread each ...", flush=True)
            runs[ep] = common.spawn(run, 2, ep, shape, args.warmup, args.steps)
        repeats.append(runs)
    tokens = [{ep: r[0]["tokens_per_step"] / r[0]["median_step_s"] for ep, r in runs.items()} for runs in repeats]
    one, two = runs[1][0], runs[2][0]
    result = {
        "shape": shape, "batch_per_rank": [BATCH, SEQ], "steps": args.steps, "warmup": args.warmup,
        "repeats": args.repeats,
        "runs": {f"E={ep}": r for ep, r in runs.items()},
        "spread": {"tokens_per_s_E2_over_E1": common.spread(t[2] / t[1] for t in tokens),
                   "all_to_all_share_E2": common.spread(rs[2][0]["all_to_all_share"] for rs in repeats)},
        "tokens_per_s": {f"E={ep}": r[0]["tokens_per_step"] / r[0]["median_step_s"] for ep, r in runs.items()},
        "expert_bytes_ratio_E2_over_E1": two["expert_param_bytes"] / one["expert_param_bytes"],
        "all_to_all_forward_bytes_per_layer_theory": theory_bytes(shape),
        "all_to_all_bytes_per_layer_mean_over_ranks": {
            phase: statistics.mean(r["all_to_all_bytes_per_layer"][phase] for r in runs[2])
            for phase in ("forward", "backward")},
        "remote_share": statistics.mean(r["remote_bytes_per_layer"]["forward"] / r["all_to_all_bytes_per_layer"]["forward"]
                                        for r in runs[2]),
    }
    for ep, r in runs.items():
        print(f"E={ep}: median step {r[0]['median_step_s']:.3f} s, {result['tokens_per_s'][f'E={ep}']:.0f} tokens/s, "
              f"expert bytes/rank {r[0]['expert_param_bytes'] / 2**20:.1f} MiB, other {r[0]['other_param_bytes'] / 2**20:.1f} MiB, "
              f"all-to-all {100 * r[0]['all_to_all_share']:.1f}% of the step, first loss {r[0]['first_loss']:.4f}")
    print(f"all-to-all bytes per MoE layer at E=2, mean over ranks: {result['all_to_all_bytes_per_layer_mean_over_ranks']} "
          f"(forward theory {theory_bytes(shape)}); {100 * result['remote_share']:.0f}% of it leaves the rank")
    sp = result["spread"]["tokens_per_s_E2_over_E1"]
    print(f"tokens/s E=2 over E=1 over {args.repeats} repeats: {sp['median']:.2f} ({sp['min']:.2f}-{sp['max']:.2f}); "
          "the rest above is the last repeat's")
    common.write_result("moe_ep", result)


if __name__ == "__main__":
    main()
