"""Model loading and the built-in token merging (tomesd with fixed settings)."""

from modules import script_callbacks, shared


def apply_token_merging(sd_model, ratio):
    """Patch with tomesd when the ratio changes; 0 removes it (as the WebUI does)."""
    import tomesd

    current = getattr(sd_model, "applied_token_merged_ratio", 0)
    if current == ratio:
        return
    if current > 0:
        tomesd.remove_patch(sd_model)
    if ratio > 0:
        tomesd.apply_patch(sd_model, ratio=ratio, use_rand=False, merge_attn=True,
                           merge_crossattn=False, merge_mlp=False)
    sd_model.applied_token_merged_ratio = ratio


def load_model(model):
    """Make ``model`` the loaded one and run the on_model_loaded callbacks."""
    shared.sd_model = model
    script_callbacks.model_loaded_callback(model)
    return model
