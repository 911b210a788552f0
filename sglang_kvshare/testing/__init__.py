"""The harness that tests and benchmarks share (like SGLang's own ``sglang.test``): starting and
stopping real servers (``server``), building annotated agent-workflow requests and reading the
server's state back (``workflows``), and a tiny random-weight Llama and LoRA adapters
(``tiny_model``).

Nothing in the serving path imports it (``tests/unit/test_layering.py`` checks this).
"""
