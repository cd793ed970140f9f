"""Natural photographs from Debian wallpaper packages, as random 64x64 crops.

The photos are not shipped with the project: ``fetch_photos`` downloads the two Debian
packages with ``apt-get download`` into a cache directory and unpacks them with
``dpkg-deb -x``, so the dataset can be rebuilt on any Debian machine that reaches the
package archive. All photos used are free licences (see ``PACKAGES``/``PHOTOS``).

Each photo belongs to one of four scene classes; one photo per class is held out and
never trained on, for evaluation (``split="heldout"``).
"""

from __future__ import annotations

import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

#: Debian (bookworm, main) packages used, with the licences from their copyright files.
PACKAGES = {
    "mate-backgrounds": {
        "version": "1.26.0-1",
        "dir": "usr/share/backgrounds/mate/nature",
        "licence": "GPL-2+ (photos in nature/)",
    },
    "lomiri-wallpapers-16.04": {
        "version": "20.04.0-2",
        "dir": "usr/share/backgrounds",
        "licence": "per photo: CC-BY-4.0, CC-BY-SA-4.0 or CC0-1.0",
    },
}

MATE, LOMIRI = "mate-backgrounds", "lomiri-wallpapers-16.04"


@dataclass(frozen=True)
class Photo:
    package: str
    file: str
    cls: int
    licence: str
    author: str
    heldout: bool = False


# fmt: off
PHOTOS = [
    Photo(LOMIRI, "Bridge_by_Sander_Klootwijk.jpg", 0, "CC-BY-SA-4.0", "Sander Klootwijk"),
    Photo(LOMIRI, "aitzgorri_by_Aitzol_Berasategi.jpg", 0, "CC-BY-4.0", "Aitzol Berasategi", True),
    Photo(LOMIRI, "picosdeeuropa_by_Aitzol_Berasategi.jpg", 0, "CC-BY-4.0", "Aitzol Berasategi"),
    Photo(LOMIRI, "sunset_by_Aitzol_Berasategi.jpg", 0, "CC-BY-4.0", "Aitzol Berasategi"),
    Photo(LOMIRI, "life_by_Aitzol_Berasategi.jpg", 0, "CC-BY-4.0", "Aitzol Berasategi"),
    Photo(MATE, "Storm.jpg", 0, "GPL-2+", "see package AUTHORS"),
    Photo(MATE, "Dune.jpg", 0, "GPL-2+", "Marco Cogoni, Hylke Bons"),
    Photo(MATE, "FreshFlower.jpg", 1, "GPL-2+", "Jens Ansorg"),
    Photo(MATE, "Garden.jpg", 1, "GPL-2+", "Charles Barbin", True),
    Photo(MATE, "YellowFlower.jpg", 1, "GPL-2+", "Charles Barbin"),
    Photo(MATE, "LadyBird.jpg", 1, "GPL-2+", "Charles Barbin"),
    Photo(MATE, "TwoWings.jpg", 1, "GPL-2+", "see package AUTHORS"),
    Photo(LOMIRI, "seeding_by_Clements_Engelhardt.jpg", 1, "CC0-1.0", "Clemens Engelhardt"),
    Photo(MATE, "Blinds.jpg", 2, "GPL-2+", "Lennart Poettering, Andrea Cimitan"),
    Photo(MATE, "GreenMeadow.jpg", 2, "GPL-2+", "see package AUTHORS"),
    Photo(MATE, "RainDrops.jpg", 2, "GPL-2+", "see package AUTHORS", True),
    Photo(LOMIRI, "Dragonfly_by_Bolly.jpg", 2, "CC-BY-SA-4.0", "Bolly"),
    Photo(LOMIRI, "Picture_0B_by_freespace.jpg", 3, "CC-BY-4.0", "Trevor Freespace", True),
    Photo(LOMIRI, "Picture_1A_by_freespace.jpg", 3, "CC-BY-4.0", "Trevor Freespace"),
    Photo(LOMIRI, "Wine_by_Jakkub_Mede.jpg", 3, "CC-BY-4.0", "Jakub Mede"),
    Photo(LOMIRI, "greentock_by_Peter_Nerlich.jpg", 3, "CC-BY-SA-4.0", "Peter Nerlich"),
    Photo(LOMIRI, "friends_by_Aitzol_Berasategi.jpg", 3, "CC-BY-4.0", "Aitzol Berasategi"),
    Photo(LOMIRI, "free_by_Peter_Nerlich.jpg", 3, "CC-BY-SA-4.0", "Peter Nerlich"),
    Photo(MATE, "Aqua.jpg", 3, "GPL-2+", "Charles Barbin"),
    Photo(MATE, "Wood.jpg", 3, "GPL-2+", "Jean-Francois Fortin Tam"),
]
# fmt: on

#: Photos are cached with this short side; crops then downscale 1x-4x from it.
SHORT_SIDE = 256


def default_cache_dir() -> Path:
    env = os.environ.get("TOME_TINYLDM_CACHE")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tome-tinyldm"


def _apt_download(package: str, version: str, cache: Path) -> Path:
    """The package's .deb in ``cache``, downloaded if missing (pinned version first)."""
    debs = sorted(cache.glob(f"{package}_*.deb"))
    if debs:
        return debs[-1]
    for spec in (f"{package}={version}", package):
        r = subprocess.run(["apt-get", "download", spec], cwd=cache, capture_output=True)
        debs = sorted(cache.glob(f"{package}_*.deb"))
        if r.returncode == 0 and debs:
            return debs[-1]
    raise RuntimeError(
        f"could not download {package} with apt-get (run 'apt-get update' first?): "
        + r.stderr.decode(errors="replace").strip()
    )


def fetch_photos(cache_dir: str | Path | None = None) -> Path:
    """Download and unpack the packages; return the directory with the extracted trees."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    root = cache / "extracted"
    for pkg, info in PACKAGES.items():
        dest = root / pkg
        if not (dest / info["dir"]).is_dir():
            cache.mkdir(parents=True, exist_ok=True)
            deb = _apt_download(pkg, info["version"], cache)
            dest.mkdir(parents=True, exist_ok=True)
            subprocess.run(["dpkg-deb", "-x", str(deb), str(dest)], check=True)
    missing = [p.file for p in PHOTOS if not _photo_path(root, p).is_file()]
    if missing:
        raise RuntimeError(f"photos missing from the packages: {missing}")
    return root


def _photo_path(root: Path, p: Photo) -> Path:
    return root / p.package / PACKAGES[p.package]["dir"] / p.file


def _load_resized(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        im.draft("RGB", (SHORT_SIDE * 2, SHORT_SIDE * 2))  # fast JPEG decode at reduced size
        im = im.convert("RGB")
        s = SHORT_SIDE / min(im.size)
        im = im.resize((round(im.width * s), round(im.height * s)), Image.LANCZOS)
        return np.asarray(im, dtype=np.uint8).transpose(2, 0, 1).copy()


def load_photos(split: str = "train", cache_dir: str | Path | None = None):
    """[(uint8 tensor (3, H, W) with short side 256, class id)] for ``train`` or ``heldout``."""
    if split not in ("train", "heldout"):
        raise ValueError(split)
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    npz = cache / f"photos{SHORT_SIDE}.npz"
    if not npz.is_file():
        root = fetch_photos(cache)
        arrays = {p.file: _load_resized(_photo_path(root, p)) for p in PHOTOS}
        np.savez(npz, **arrays)
    with np.load(npz) as z:
        return [
            (torch.from_numpy(z[p.file]), p.cls)
            for p in PHOTOS
            if p.heldout == (split == "heldout")
        ]


def random_crops(photos, n: int, size: int, generator: torch.Generator):
    """``n`` random crops -> (images (n, 3, size, size) in [0, 1], class ids (n,)).

    Class-balanced. Each crop window is ``size`` times a log-uniform factor in [1, 4]
    of the cached photo (so a 64 px crop spans 1/4 to all of the short side and shows
    whole structures), resized with antialiasing, and flipped left-right half the time.
    Only ``generator`` is used for randomness.
    """
    by_class: dict[int, list] = {}
    for img, c in photos:
        by_class.setdefault(c, []).append(img)
    classes = sorted(by_class)
    u = torch.rand((n, 6), generator=generator)
    out, ids = [], []
    for r in u.tolist():
        c = classes[min(int(r[0] * len(classes)), len(classes) - 1)]
        imgs = by_class[c]
        img = imgs[min(int(r[1] * len(imgs)), len(imgs) - 1)]
        _, h, w = img.shape
        win = min(round(size * math.exp(r[2] * math.log(4))), h, w)
        y, x = int(r[3] * (h - win + 1)), int(r[4] * (w - win + 1))
        crop = img[None, :, y : y + win, x : x + win].float() / 255
        crop = F.interpolate(crop, size=(size, size), mode="bilinear", antialias=True)
        out.append(crop.flip(-1) if r[5] < 0.5 else crop)
        ids.append(c)
    return torch.cat(out).clamp(0, 1), torch.tensor(ids, dtype=torch.long)


def heldout_batch(n: int = 16, size: int = 64, seed: int = 0, cache_dir=None):
    """A fixed batch of crops from the held-out photos (never trained on)."""
    g = torch.Generator().manual_seed(seed)
    return random_crops(load_photos("heldout", cache_dir), n, size, g)


def sources() -> str:
    """One line per package, for the weights' metadata and the model card."""
    return "; ".join(
        f"Debian package {k} {v['version']} ({v['licence']})" for k, v in PACKAGES.items()
    )
