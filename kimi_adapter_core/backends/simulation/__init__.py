"""Simulation backend: size a deployment (``kadapt plan``) and price one step (``kadapt simulate``).

The planner (``arch``, ``params``, ``quant``, ``parallel``, ``planner``) is pure Python and reads the
raw hub config, so ``kadapt plan`` never imports torch. The simulator (``tracer``, ``rank_model``,
``cost``, ``simulator``) traces one dense and one MoE layer of the per-rank model on the meta device
and prices every recorded op with a roofline; see ``docs/cost_model.md``.
"""
