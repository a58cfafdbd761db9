"""Simulation backend: size a deployment (``kadapt plan``) and price one step (``kadapt simulate``).

Both read the model through its ``ModelStructure`` (``kimi_adapter_core.structure``), so every
decoder family it describes works: MHA/GQA/MQA or MLA attention, dense or MoE MLPs, sliding-window
layers. The planner (``arch``, ``params``, ``quant``, ``parallel``, ``planner``) is pure Python and
reads the raw hub config, so ``kadapt plan`` never imports torch. The simulator (``tracer``,
``rank_model``, ``cost``, ``simulator``) traces the first decoder layer of each kind (dense, MoE) of
the per-rank model on the meta device and prices every recorded op with a roofline scaled by the
device's measured kernel-efficiency table (``kernels``, data in ``kernels/*.yaml`` made by
``calibrate``), or with NVIDIA AIConfigurator's measured tables (``aiconfigurator``, optional); see
``docs/cost_model.md``.
"""
