"""``comfy.patcher_extension`` as ComfyUI 0.8.0 behaves (written from its observed behaviour):
wrappers are kept as ``{wrapper_type: {key: [fn, ...]}}`` in a patcher and, for a sampling
run, in ``transformer_options["wrappers"]``; ``get_all_wrappers`` lists every key's functions
in insertion order (the first added runs outermost); a wrapper is called as
``fn(executor, *args, **kwargs)`` and calls ``executor(*args, **kwargs)`` to go on;
``executor.class_obj`` is the object whose method is wrapped (the model base for
``APPLY_MODEL``, the diffusion model for ``DIFFUSION_MODEL``)."""


class CallbacksMP:
    ON_CLONE = "on_clone"
    ON_CLEANUP = "on_cleanup"
    ON_PRE_RUN = "on_pre_run"
    ON_PREPARE_STATE = "on_prepare_state"


class WrappersMP:
    OUTER_SAMPLE = "outer_sample"
    PREDICT_NOISE = "predict_noise"
    CALC_COND_BATCH = "calc_cond_batch"
    APPLY_MODEL = "apply_model"
    DIFFUSION_MODEL = "diffusion_model"


def add_wrapper_with_key(wrapper_type, key, wrapper, transformer_options, is_model_options=False):
    if is_model_options:
        transformer_options = transformer_options.setdefault("transformer_options", {})
    wrappers = transformer_options.setdefault("wrappers", {})
    wrappers.setdefault(wrapper_type, {}).setdefault(key, []).append(wrapper)


def get_all_wrappers(wrapper_type, transformer_options, is_model_options=False):
    if is_model_options:
        transformer_options = transformer_options.get("transformer_options", {})
    found = []
    for fns in transformer_options.get("wrappers", {}).get(wrapper_type, {}).values():
        found.extend(fns)
    return found


class WrapperExecutor:
    def __init__(self, original, class_obj, wrappers, idx):
        self.original, self.class_obj = original, class_obj
        self.wrappers, self.idx = list(wrappers), idx

    def __call__(self, *args, **kwargs):
        return WrapperExecutor(self.original, self.class_obj, self.wrappers,
                               self.idx + 1).execute(*args, **kwargs)

    def execute(self, *args, **kwargs):
        if self.idx == len(self.wrappers):
            return self.original(*args, **kwargs)
        return self.wrappers[self.idx](self, *args, **kwargs)

    @classmethod
    def new_class_executor(cls, original, class_obj, wrappers, idx=0):
        return cls(original, class_obj, wrappers, idx)

    @classmethod
    def new_executor(cls, original, wrappers, idx=0):
        return cls(original, None, wrappers, idx)


def merge_nested_dicts(dict1, dict2, copy_dict1=True):
    """``dict2`` merged into (a copy of) ``dict1``: dicts recursively, lists concatenated."""
    merged = copy_nested_dicts(dict1) if copy_dict1 else dict1
    for key, value in dict2.items():
        if isinstance(value, dict):
            merged[key] = merge_nested_dicts(merged.setdefault(key, {}), value)
        elif isinstance(value, list):
            merged.setdefault(key, []).extend(value)
        else:
            merged[key] = value
    return merged


def copy_nested_dicts(d):
    out = d.copy()
    for key, value in d.items():
        if isinstance(value, dict):
            out[key] = copy_nested_dicts(value)
        elif isinstance(value, list):
            out[key] = value.copy()
    return out
