"""``ModelPatcher`` as ComfyUI 0.8.0 keeps its patch contract.

A clone is a new patcher around the same model: weight patches copied per key, ``model_options``
deep-copied (patch functions in it too: bound methods are deep-copied with their instance
unless it says otherwise), wrappers and callbacks copied per key; no other attribute is
carried over. ``pre_run``/``cleanup`` call the ``CallbacksMP.ON_PRE_RUN``/``ON_CLEANUP`` callbacks
(read at each call, as ComfyUI names them) with
the patcher (``CFGGuider.outer_sample`` calls them around a sampling, ``cleanup`` in
``finally``); ``prepare_state`` calls the ``on_prepare_state`` callbacks each step.
"""

import copy

import torch

from comfy.patcher_extension import CallbacksMP


class ModelPatcher:
    def __init__(self, model, load_device=None, offload_device=None):
        self.model = model
        self.load_device = load_device or torch.device("cpu")
        self.offload_device = offload_device or torch.device("cpu")
        self.patches = {}  # weight patches (by weight name), not attention patches
        self.model_options = {"transformer_options": {}}
        self.wrappers = {}
        self.callbacks = {}

    def clone(self):
        n = self.__class__(self.model, self.load_device, self.offload_device)
        n.patches = {k: v[:] for k, v in self.patches.items()}
        n.model_options = copy.deepcopy(self.model_options)
        n.wrappers = {k: {k1: w1.copy() for k1, w1 in w.items()} for k, w in self.wrappers.items()}
        n.callbacks = {k: {k1: c1.copy() for k1, c1 in c.items()}
                       for k, c in self.callbacks.items()}
        return n

    def add_callback(self, call_type, callback):
        self.add_callback_with_key(call_type, None, callback)

    def add_callback_with_key(self, call_type, key, callback):
        self.callbacks.setdefault(call_type, {}).setdefault(key, []).append(callback)

    def remove_callbacks_with_key(self, call_type, key):
        c = self.callbacks.get(call_type, {})
        if key in c:
            c.pop(key)

    def get_callbacks(self, call_type, key):
        return self.callbacks.get(call_type, {}).get(key, [])

    def get_all_callbacks(self, call_type):
        return [fn for fns in self.callbacks.get(call_type, {}).values() for fn in fns]

    def pre_run(self):
        for callback in self.get_all_callbacks(CallbacksMP.ON_PRE_RUN):
            callback(self)

    def cleanup(self):
        for callback in self.get_all_callbacks(CallbacksMP.ON_CLEANUP):
            callback(self)

    def prepare_state(self, timestep, model_options=None):
        """Each step, in ``calc_cond_batch`` before the model calls: the ``on_prepare_state``
        callbacks, called ``(patcher, timestep, model_options)`` as current ComfyUI does
        (0.8.0 passes ``(patcher, timestep)``; no callback of 0.8.0's core uses it)."""
        for callback in self.get_all_callbacks(CallbacksMP.ON_PREPARE_STATE):
            callback(self, timestep, model_options)

    def set_model_patch(self, patch, name):
        to = self.model_options["transformer_options"]
        if "patches" not in to:
            to["patches"] = {}
        to["patches"][name] = to["patches"].get(name, []) + [patch]

    def set_model_attn1_patch(self, patch):
        self.set_model_patch(patch, "attn1_patch")

    def set_model_attn1_output_patch(self, patch):
        self.set_model_patch(patch, "attn1_output_patch")

    def set_model_patch_replace(self, patch, name, block_name, number, transformer_index=None):
        to = self.model_options["transformer_options"]
        key = (block_name, number) if transformer_index is None \
            else (block_name, number, transformer_index)
        to.setdefault("patches_replace", {}).setdefault(name, {})[key] = patch

    def set_model_attn1_replace(self, patch, block_name, number, transformer_index=None):
        self.set_model_patch_replace(patch, "attn1", block_name, number, transformer_index)

    def get_model_object(self, name):
        """An attribute of the model (``model_sampling``, ``diffusion_model``, ...)."""
        return getattr(self.model, name)

    def add_wrapper_with_key(self, wrapper_type, key, wrapper):
        self.wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)

    def remove_wrappers_with_key(self, wrapper_type, key):
        self.wrappers.get(wrapper_type, {}).pop(key, None)

    def get_wrappers(self, wrapper_type, key):
        return self.wrappers.get(wrapper_type, {}).get(key, [])
