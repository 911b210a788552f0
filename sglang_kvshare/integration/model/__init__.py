"""The model forward (the scheduler process's model runner): the ``kvshare_torch`` attention
backend, selective recomputation's decoder-layer hook, and PReCache's LR pool with its LoRA hooks.
Never imports ``scheduler/``."""
