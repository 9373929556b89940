"""Shared test set-up: multi-rank checks go through ``harness.run``; one thread per process unless
``OMP_NUM_THREADS`` asks for more (other thread counts sum in other orders: the tolerances in
``reference.py`` must hold for all of them)."""

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
