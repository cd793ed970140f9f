"""Processing objects and ``process_images`` with the WebUI's hook order (contract section 2).

Sampling is a toy Euler loop around the loaded model's real UNet
(``shared.sd_model.model.diffusion_model``), cond and uncond in one batch. Noise comes from
per-seed generators, never from the global torch RNG, as in the WebUI.
"""

import hashlib
from types import SimpleNamespace

import torch

from modules import infotext_utils, script_callbacks, sd_models, shared

unet_call_observers = []  # functions(p, model) run right before every UNet call
# A1111 samples under torch.no_grad; Forge and ComfyUI under torch.inference_mode.
sampling_mode = torch.no_grad


class StableDiffusionProcessing:
    token_merging_ratio = 0
    token_merging_ratio_hr = 0

    def __init__(self, prompt="a cat", seed=1, steps=3, width=128, height=128, batch_size=1,
                 n_iter=1, cfg_scale=5.0, override_settings=None,
                 override_settings_restore_afterwards=True, **kwargs):
        self.prompt, self.seed, self.steps = prompt, seed, steps
        self.width, self.height, self.batch_size, self.n_iter = width, height, batch_size, n_iter
        self.cfg_scale = cfg_scale
        self.override_settings = dict(override_settings or {})
        self.override_settings_restore_afterwards = override_settings_restore_afterwards
        self.extra_generation_params = {}
        self.scripts_value = None
        self.script_args_value = None
        self.scripts_setup_complete = False
        self.is_api = False
        self.all_seeds = self.seeds = None
        self.comments = {}
        for k, v in kwargs.items():
            setattr(self, k, v)

    @property
    def sd_model(self):
        return shared.sd_model

    @sd_model.setter
    def sd_model(self, value):
        pass

    @property
    def scripts(self):
        return self.scripts_value

    @scripts.setter
    def scripts(self, value):
        self.scripts_value = value
        if self.scripts_value and self.script_args_value and not self.scripts_setup_complete:
            self.setup_scripts()

    @property
    def script_args(self):
        return self.script_args_value

    @script_args.setter
    def script_args(self, value):
        self.script_args_value = value
        if self.scripts_value and self.script_args_value and not self.scripts_setup_complete:
            self.setup_scripts()

    def setup_scripts(self):
        self.scripts_setup_complete = True
        self.scripts.setup_scrips(self, is_ui=not self.is_api)

    def init(self, all_prompts, all_seeds, all_subseeds):
        pass

    def close(self):
        self.closed = getattr(self, "closed", 0) + 1

    def get_token_merging_ratio(self, for_hr=False):
        if for_hr:
            return (self.token_merging_ratio_hr or shared.opts.token_merging_ratio_hr
                    or self.token_merging_ratio or shared.opts.token_merging_ratio)
        return self.token_merging_ratio or shared.opts.token_merging_ratio

    # --- the toy sampler ------------------------------------------------------------------
    def conds(self, batch):
        h = int(hashlib.sha256(self.prompt.encode()).hexdigest()[:8], 16)
        g = torch.Generator().manual_seed(h)
        dim = shared.sd_model.context_dim
        cond = torch.randn(1, 7, dim, generator=g).expand(batch, -1, -1)
        return cond, torch.zeros(batch, 7, dim)

    def noise(self, shape):
        return torch.cat([torch.randn(shape, generator=torch.Generator().manual_seed(s))
                          for s in self.seeds])

    def denoise(self, x, steps, t_from=999.0):
        if hasattr(shared.sd_model, "forge_objects_original"):  # Forge Neo: its own sampler
            import neo
            return neo.denoise(self, x, steps, self.neo_step)
        batch = x.shape[0]
        cond, uncond = self.conds(batch)
        denoiser = SimpleNamespace(p=self)
        for i, t in enumerate(torch.linspace(t_from, 0.0, steps)):
            refiner = getattr(self, "refiner_model", None)
            if refiner is not None and i == getattr(self, "refiner_switch_at", 1) \
                    and shared.sd_model is not refiner:
                sd_models.load_model(refiner)  # the WebUI swaps inside the sampler
            params = script_callbacks.CFGDenoiserParams(x, None, t, i, steps, cond, uncond,
                                                        denoiser=denoiser)
            script_callbacks.cfg_denoiser_callback(params)
            if getattr(self, "fail_at_step", None) == (bool(getattr(self, "is_hr_pass", 0)), i):
                raise RuntimeError("simulated failure during sampling")
            model = shared.sd_model
            for observe in unet_call_observers:
                observe(self, model)
            with sampling_mode():
                out = model.model.diffusion_model(torch.cat([x, x]),
                                                  torch.full((2 * batch,), float(t)),
                                                  torch.cat([cond, uncond]))
            eps_c, eps_u = out.chunk(2)
            x = x - 0.1 * (eps_u + self.cfg_scale * (eps_c - eps_u))
        return x


    def neo_step(self, i):
        """Forge Neo's sampler, before step ``i`` (None: before sampling): the WebUI's per-step
        callbacks; the model to call now."""
        if i is not None:
            params = script_callbacks.CFGDenoiserParams(None, None, None, i, self.steps, None,
                                                        None, denoiser=SimpleNamespace(p=self))
            script_callbacks.cfg_denoiser_callback(params)
            if getattr(self, "fail_at_step", None) == (bool(getattr(self, "is_hr_pass", 0)), i):
                raise RuntimeError("simulated failure during sampling")
            for observe in unet_call_observers:
                observe(self, shared.sd_model)
        return shared.sd_model

    def latent_shape(self):
        latent = getattr(self.sd_model, "latent_shape", None)  # Forge Neo: per model kind
        if latent is not None:
            return (1, *latent(self.height, self.width))
        return (1, 4, self.height // 8, self.width // 8)


class StableDiffusionProcessingTxt2Img(StableDiffusionProcessing):
    def __init__(self, enable_hr=False, hr_scale=2.0, denoising_strength=0.5,
                 hr_second_pass_steps=0, firstpass_image=None, **kwargs):
        self.enable_hr, self.hr_scale = enable_hr, hr_scale
        self.denoising_strength = denoising_strength
        self.hr_second_pass_steps = hr_second_pass_steps
        self.firstpass_image = firstpass_image
        self.is_hr_pass = False
        self.hr_model = None  # a hires checkpoint, loaded before the hires pass
        self.hr_upscale_to_x = self.hr_upscale_to_y = 0
        super().__init__(**kwargs)

    def init(self, all_prompts, all_seeds, all_subseeds):
        if self.enable_hr:  # the hires pass's target size, in pixels
            self.hr_upscale_to_x = int(self.width * self.hr_scale)
            self.hr_upscale_to_y = int(self.height * self.hr_scale)

    def sample(self):
        shape = self.latent_shape()
        if self.firstpass_image is None:
            x = self.noise(shape)
            reset_forge_objects(self.sd_model)
            if self.scripts is not None:
                self.scripts.process_before_every_sampling(self, x=x, noise=x, c=None, uc=None)
            samples = self.denoise(x, self.steps)
        else:  # the "Upscale" button: the first pass is the given image
            samples = self.firstpass_image
        if not self.enable_hr:
            return samples
        if self.hr_model is not None and shared.sd_model is not self.hr_model:
            sd_models.load_model(self.hr_model)
        return self.sample_hr_pass(samples)

    def sample_hr_pass(self, samples):
        self.is_hr_pass = True
        x = torch.nn.functional.interpolate(samples, scale_factor=self.hr_scale, mode="nearest")
        noise = self.noise((1, *x.shape[1:]))
        x = x + noise * self.denoising_strength
        sd_models.apply_token_merging(self.sd_model, self.get_token_merging_ratio(for_hr=True))
        if self.scripts is not None:
            self.scripts.before_hr(self)
            reset_forge_objects(self.sd_model)
            self.scripts.process_before_every_sampling(self, x=x, noise=noise, c=None, uc=None)
        out = self.denoise(x, self.hr_second_pass_steps or self.steps,
                           t_from=999.0 * self.denoising_strength)
        sd_models.apply_token_merging(self.sd_model, self.get_token_merging_ratio())
        self.is_hr_pass = False
        return out


class StableDiffusionProcessingImg2Img(StableDiffusionProcessing):
    def __init__(self, init_images=None, denoising_strength=0.75, **kwargs):
        self.init_images, self.denoising_strength = init_images, denoising_strength
        super().__init__(**kwargs)

    def get_token_merging_ratio(self, for_hr=False):
        o = shared.opts
        return (self.token_merging_ratio or ("token_merging_ratio" in self.override_settings
                                             and o.token_merging_ratio)
                or o.token_merging_ratio_img2img or o.token_merging_ratio)

    def sample(self):
        init = self.init_images
        if init is None:
            init = torch.zeros(self.latent_shape())
        init = init.expand(len(self.seeds), -1, -1, -1)
        noise = self.noise((1, *init.shape[1:]))
        reset_forge_objects(self.sd_model)
        if self.scripts is not None:
            self.scripts.process_before_every_sampling(self, x=init, noise=noise, c=None, uc=None)
        x = init + noise * self.denoising_strength
        return self.denoise(x, self.steps, t_from=999.0 * self.denoising_strength)


def reset_forge_objects(model):
    """Forge Neo, right before ``process_before_every_sampling``: the job's UNet patcher again
    (``forge_objects_after_applying_lora``), so a clone patched for one pass never outlives it."""
    after = getattr(model, "forge_objects_after_applying_lora", None)
    if after is not None:
        model.forge_objects = after.shallow_copy()


class Processed:
    def __init__(self, p, images, infotexts):
        self.images, self.infotexts = images, infotexts
        self.info = infotexts[0] if infotexts else ""
        self.extra_generation_params = dict(p.extra_generation_params)


def create_infotext(p, index=0):
    params = {"Steps": p.steps, "Seed": p.all_seeds[index], "Size": f"{p.width}x{p.height}"}
    if getattr(p, "enable_hr", False):
        params["Denoising strength"] = p.denoising_strength
    for k, v in p.extra_generation_params.items():
        params[k] = v(p, index) if callable(v) else v
    ratio = p.get_token_merging_ratio()
    params["Token merging ratio"] = ratio if ratio else None
    hr = p.get_token_merging_ratio(for_hr=True) if getattr(p, "enable_hr", False) else 0
    params["Token merging ratio hr"] = hr if hr else None
    return f"{p.prompt}\n{infotext_utils.create_text(params)}"


def process_images(p):
    if p.scripts is not None:
        p.scripts.before_process(p)
    opts = shared.opts
    stored = {k: opts.data.get(k, opts.get_default(k)) for k in p.override_settings
              if k in opts.data}
    try:
        for k, v in p.override_settings.items():
            opts.set(k, v, is_api=True, run_callbacks=False)
        sd_models.apply_token_merging(p.sd_model, p.get_token_merging_ratio())
        return process_images_inner(p)
    finally:
        sd_models.apply_token_merging(p.sd_model, 0)
        if p.override_settings_restore_afterwards:
            for k, v in stored.items():
                setattr(opts, k, v)


def process_images_inner(p):
    total = p.batch_size * p.n_iter
    if p.all_seeds is None:
        p.all_seeds = [int(p.seed) + i for i in range(total)]
    p.all_prompts = [p.prompt] * total
    if p.scripts is not None:
        p.scripts.process(p)
    p.init(p.all_prompts, p.all_seeds, p.all_seeds)
    images, infotexts = [], []
    for n in range(p.n_iter):
        if shared.state.interrupted:
            break
        p.seeds = p.all_seeds[n * p.batch_size:(n + 1) * p.batch_size]
        if p.scripts is not None:
            p.scripts.before_process_batch(p, batch_number=n, prompts=p.all_prompts,
                                           seeds=p.seeds, subseeds=p.seeds)
            p.scripts.process_batch(p, batch_number=n, prompts=p.all_prompts, seeds=p.seeds,
                                    subseeds=p.seeds)
        samples = p.sample()
        if p.scripts is not None:
            p.scripts.postprocess_batch(p, samples, batch_number=n)
        for i in range(samples.shape[0]):
            images.append(samples[i])
            infotexts.append(create_infotext(p, n * p.batch_size + i))
    res = Processed(p, images, infotexts)
    if p.scripts is not None:
        p.scripts.postprocess(p, res)
    return res
