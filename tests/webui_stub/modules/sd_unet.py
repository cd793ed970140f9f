current_unet = None  # an "SD Unet" replacement (e.g. TensorRT) when not None
