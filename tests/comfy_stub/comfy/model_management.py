"""``load_models_gpu``: ComfyUI moves the patchers' models to their load device."""

LOADED = []


def load_models_gpu(models, *args, **kwargs):
    for m in models:
        m.model.to(m.load_device)
        LOADED.append(m)
