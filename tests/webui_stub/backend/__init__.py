"""A stand-in for Forge Neo's ``backend`` package: the parts the ToMe swap adapter meets.

Written for these tests from Forge Neo 2.26's observed behaviour (Neo is AGPL: nothing is
copied). What is faithful: module names, the attention functions bound **by name at import**
in each model module (``backend/nn/flux.py`` ``attention``, ``wan.py`` ``attention``,
``qwen.py`` and ``lumina.py`` ``attention_function``) and their call forms (argument order,
tensor layouts, RoPE before or inside the call), the joint sequence orders, the token grids
(``patch_size``, padding), the ``UnetPatcher``'s ``model_options`` and its single
``model_function_wrapper`` slot, and the k-diffusion sigmas Neo hands the model. The models
are tiny and random; their layers are our own.
"""
