"""Where ``smp.resume_from_checkpoint`` spends its time on one device: the ``ckpt-ours`` model of
``bench_gpu.py`` saved once, then resumed under cProfile; prints the top functions by own and
cumulative time. Usage: ``python bench/profile_resume.py --layers 8 --hidden 2048 --ckpt-dir DIR``."""

import cProfile
import pstats
import sys
import time

import bench_gpu
import gpu_variants


def main() -> None:
    args = bench_gpu.parse_args(sys.argv[1:])
    device = gpu_variants.device_of(args)
    if device.type == "cuda":
        gpu_variants._torch().cuda.set_device(device)
    step, _, _ = gpu_variants.ours_v1(args, device)
    step()
    import modelparallel as smp

    smp.save_checkpoint(args.ckpt_dir, "p", async_save=False)
    prof = cProfile.Profile()
    start = time.perf_counter()
    prof.enable()
    smp.resume_from_checkpoint(args.ckpt_dir)
    gpu_variants.sync(device)
    prof.disable()
    print(f"resume {time.perf_counter() - start:.2f} s", flush=True)
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof).sort_stats(key).print_stats(30)


if __name__ == "__main__":
    main()
