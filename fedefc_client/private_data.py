"""A SuperNode's own private training data, read from the path in its node config.

The formats are documented in docs/DEPLOYMENT.md ("Node data", mode (b)).
``data-path`` names one of:

- an ``.npz`` file with ``images``: uint8, shaped (N, H, W) (one channel), (N, C, H, W)
  or (N, H, W, C); and ``labels``: integers in 0..K-1, shaped (N,);
- a folder in torchvision's ImageFolder layout, ``<root>/<class>/<image file>``, whose
  class folders are named by the class INDEX (``0`` .. ``K-1``, the run dataset's label
  order); images are decoded with Pillow to grayscale or RGB.

The data is decoded once into uint8 N x C x H x W and checked against the run's
dataset (channels, image size, number of classes): the model, the normalization and
the server's test set all come from that dataset. Every problem raises
:class:`PrivateDataError` naming the node, the path and the fix.
"""

from __future__ import annotations

import io
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError  # Pillow comes with torchvision

from common.datasets import NORMALIZATION, NUM_CLASSES
from common.results import atomic_write_bytes

IMAGE_SIZE = {"mnist-embedded": 28, "mnist": 28, "cifar10": 32, "cifar100": 32}
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff",
                  ".webp")


class PrivateDataError(ValueError):
    """A node's private data is missing or malformed; the message names node, path and fix."""


@dataclass(frozen=True)
class ImageSpec:
    """What the run's dataset fixes for every client's images."""

    dataset: str
    channels: int
    size: int
    num_classes: int

    @classmethod
    def of(cls, dataset: str) -> ImageSpec:
        return cls(dataset, len(NORMALIZATION[dataset][0]), IMAGE_SIZE[dataset],
                   NUM_CLASSES[dataset])

    def describe(self) -> str:
        return (f"dataset {self.dataset!r} needs {self.channels}x{self.size}x{self.size} "
                f"uint8 images and labels 0..{self.num_classes - 1}")


def load_private_data(path: str, spec: ImageSpec, node: str) -> tuple[np.ndarray, np.ndarray]:
    """The node's images (uint8 N x C x H x W) and labels (int64 N) from ``path``."""
    src = Path(path)
    if not src.is_absolute():
        raise PrivateDataError(f"{node}: data-path={path!r} is not absolute; give the absolute "
                               "path of an .npz file or an ImageFolder directory")
    if src.is_dir():
        images, labels = _read_image_folder(src, spec, node)
    elif src.is_file():
        images, labels = _read_npz(src, spec, node)
    else:
        raise PrivateDataError(f"{node}: data-path={path!r} does not exist; point it at an "
                               ".npz file (images, labels) or an ImageFolder directory")
    if len(labels) == 0:
        raise PrivateDataError(f"{node}: data-path={path!r} holds no samples")
    bad = (labels < 0) | (labels >= spec.num_classes)
    if bad.any():
        raise PrivateDataError(
            f"{node}: data-path={path!r}: label {int(labels[bad][0])} is outside "
            f"0..{spec.num_classes - 1}; {spec.describe()}")
    return images, labels


def _read_npz(src: Path, spec: ImageSpec, node: str) -> tuple[np.ndarray, np.ndarray]:
    def fail(problem: str) -> PrivateDataError:
        return PrivateDataError(f"{node}: data-path={str(src)!r}: {problem}")

    how = "write it with numpy.savez(path, images=..., labels=...)"
    try:
        loaded = np.load(src, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise fail(f"not a readable .npz file ({err}); {how}") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise fail(f"holds a single array, not an .npz archive; {how}")
    try:
        with loaded as npz:
            arrays = {key: npz[key] for key in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise fail(f"an array cannot be read ({err}); {how}") from None
    missing = [key for key in ("images", "labels") if key not in arrays]
    if missing:
        raise fail(f"has no {' / '.join(missing)} array (arrays: {sorted(arrays)}); "
                   "store images=uint8 images and labels=integer labels")
    images, labels = arrays["images"], arrays["labels"]
    if images.dtype != np.uint8:
        raise fail(f"images have dtype {images.dtype}; store uint8 pixel values 0..255")
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise fail(f"labels have shape {labels.shape} and dtype {labels.dtype}; "
                   "store a 1-D integer array")
    if len(labels) != len(images):
        raise fail(f"{len(images)} images but {len(labels)} labels")
    return _as_nchw(images, spec, fail), labels.astype(np.int64)


def _as_nchw(images: np.ndarray, spec: ImageSpec, fail) -> np.ndarray:
    """(N,H,W), (N,C,H,W) or (N,H,W,C) -> (N,C,H,W), the layout decided by ``spec``."""
    c, s = spec.channels, spec.size
    if images.ndim == 3 and c == 1 and images.shape[1:] == (s, s):
        return np.ascontiguousarray(images[:, None])
    if images.ndim == 4 and images.shape[1:] == (c, s, s):
        return np.ascontiguousarray(images)
    if images.ndim == 4 and images.shape[1:] == (s, s, c):
        return np.ascontiguousarray(images.transpose(0, 3, 1, 2))
    layouts = ([f"(N, {s}, {s})"] if c == 1 else []) + [f"(N, {c}, {s}, {s})",
                                                         f"(N, {s}, {s}, {c})"]
    raise fail(f"images have shape {images.shape}; {spec.describe()}, shaped "
               f"{' or '.join(layouts)}")


def _read_image_folder(root: Path, spec: ImageSpec, node: str
                       ) -> tuple[np.ndarray, np.ndarray]:
    def fail(problem: str) -> PrivateDataError:
        return PrivateDataError(f"{node}: data-path={str(root)!r}: {problem}")

    classes = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not classes:
        raise fail("has no class folders; use the ImageFolder layout <root>/<class index>/"
                   "<image>, e.g. <root>/0/a.png")
    mode = "L" if spec.channels == 1 else "RGB"
    images, labels = [], []
    for folder in classes:
        if not folder.name.isdigit() or int(folder.name) >= spec.num_classes:
            raise fail(f"class folder {folder.name!r} is not a class index 0.."
                       f"{spec.num_classes - 1}; name class folders by the index of the "
                       f"run dataset's class ({spec.dataset})")
        for file in sorted(folder.iterdir()):
            if file.suffix.lower() not in IMAGE_SUFFIXES or file.name.startswith("."):
                continue
            try:
                with Image.open(file) as img:
                    pixels = np.asarray(img.convert(mode), dtype=np.uint8)
            except (OSError, UnidentifiedImageError) as err:
                raise PrivateDataError(f"{node}: image {str(file)!r} under data-path="
                                       f"{str(root)!r} cannot be decoded ({err})") from None
            if pixels.shape[:2] != (spec.size, spec.size):
                raise PrivateDataError(
                    f"{node}: image {str(file)!r} under data-path={str(root)!r} is "
                    f"{pixels.shape[1]}x{pixels.shape[0]} pixels; {spec.describe()}")
            images.append(pixels.reshape(spec.size, spec.size, spec.channels))
            labels.append(int(folder.name))
    if not images:
        raise fail(f"its class folders hold no image files ({', '.join(IMAGE_SUFFIXES)})")
    return (np.ascontiguousarray(np.stack(images).transpose(0, 3, 1, 2)),
            np.asarray(labels, dtype=np.int64))


def write_npz(path: Path, images: np.ndarray, labels: np.ndarray) -> None:
    """Write ``images`` and ``labels`` as an .npz in the accepted format (atomically;
    mode 0644, so a container's SuperExec user can read it from a read-only mount)."""
    buf = io.BytesIO()
    np.savez(buf, images=np.asarray(images, dtype=np.uint8),
             labels=np.asarray(labels, dtype=np.int64))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())
    path.chmod(0o644)
