"""A dataset file a user brings: an ``.npz`` of images or feature vectors with their
labels, or an ImageFolder directory (formats: docs/OWN-DATA.md, "Formats").

- ``.npz`` with ``labels`` (integers ``0..K-1``, shape (N,)) and exactly one of
  ``images`` (uint8 pixels, shaped (N, H, W), (N, C, H, W) or (N, H, W, C)) or
  ``features`` (real numbers, shaped (N, D), stored as float32);
  An optional boolean ``verified`` (N,) marks the samples whose labels were checked
  (docs/OWN-DATA.md, "Verified labels"); an optional text ``class_names`` (K,) names
  the classes in index order, as ``fedefc data`` writes it (its fingerprint,
  :func:`class_map_fingerprint`, is what a node declares: docs/OWN-DATA.md, "Preparing a
  folder of images");
- a folder ``<root>/<class index>/<image file>`` (class folders named ``0`` .. ``K-1``,
  so that a label means the same class on every node), decoded with Pillow to
  grayscale or RGB; every image must have the same size.

Images become uint8 (N, C, H, W); features float32 (N, D); labels int64 (N,). When the
expected input shape is known (``expected``: (C, H, W) or (D,)), the data must have it;
otherwise a 4-D array's channel axis is the smaller of axes 1 and 3. Every problem
raises :class:`DatasetError` naming the source (``where``: e.g. ``data-path='/d.npz'``),
what was found and the fix. :func:`read_header` gives a file's input shape and its
number of classes without decoding images or features (the server of a run whose data
the clients hold, docs/OWN-DATA.md, "The server holds no data").
"""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError  # Pillow comes with torchvision

from .results import atomic_write_bytes

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".ppm", ".pgm", ".tif", ".tiff",
                  ".webp")
SAVEZ = ("numpy.savez(path, images=uint8 images, labels=integer labels) or "
         "numpy.savez(path, features=float vectors, labels=integer labels)")


class DatasetError(ValueError):
    """A dataset is missing or malformed; the message names the path and the fix."""


class PrivateDataError(DatasetError):
    """A node's private data is missing or malformed; the message names node, path and fix
    (raised by :mod:`fedefc_client.private_data` and, for its ``verified`` mask, by
    :mod:`common.sample_roles`)."""


@dataclass(frozen=True)
class Samples:
    """Decoded samples: uint8 (N, C, H, W) images or float32 (N, D) features, int64
    labels, and the mask of verified labels where the file has one."""

    x: np.ndarray
    y: np.ndarray
    verified: np.ndarray | None = None
    class_names: tuple[str, ...] | None = None  # the file's class map, in index order

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(int(d) for d in self.x.shape[1:])


def class_map_fingerprint(names: tuple[str, ...] | list[str]) -> str:
    """A class map as a node declares it, without its names (they may be private):
    ``K:`` and the first 16 hex digits of the SHA-256 of the names in index order, so
    two maps agree exactly when both their names and their order do."""
    digest = hashlib.sha256(json.dumps(list(names)).encode()).hexdigest()
    return f"{len(names)}:{digest[:16]}"


def shape_text(shape: tuple[int, ...]) -> str:
    """(3, 12, 20) -> '3x12x20'; (13,) -> '13' (the ``input-shape`` key's format)."""
    return "x".join(str(d) for d in shape)


def describe_shape(shape: tuple[int, ...]) -> str:
    """What a sample of ``shape`` is, in words."""
    if len(shape) == 3:
        return f"{shape_text(shape)} (C x H x W) uint8 images"
    return f"{shape[0]} float features"


def _fail(where: str, problem: str) -> DatasetError:
    return DatasetError(f"{where}: {problem}")


def read_samples(path: str, where: str,
                 expected: tuple[int, ...] | None = None) -> Samples:
    """The samples in the .npz file or ImageFolder directory at ``path``."""
    src = _existing(path, where)
    samples = _read_folder(src, where, expected) if src.is_dir() else _read_npz(src, where,
                                                                               expected)
    if len(samples.y) == 0:
        raise _fail(where, "holds no samples")
    return samples


def read_header(path: str, where: str,
                expected: tuple[int, ...] | None = None) -> tuple[tuple[int, ...], int]:
    """(input shape, K = largest label + 1) of the data at ``path``, read from the .npz
    array header and its labels (or from the folder names and the first image): no
    image or feature is decoded."""
    src = _existing(path, where)
    if src.is_dir():
        classes = _class_folders(src, where)
        first = next((f for folder in classes for f in _image_files(folder)), None)
        if first is None:
            raise _fail(where, "its class folders hold no image files "
                               f"({', '.join(IMAGE_SUFFIXES)})")
        pixels = _decode(first, expected[0] if expected and len(expected) == 3 else None,
                         where)
        shape = (pixels.shape[2], pixels.shape[0], pixels.shape[1])
        if expected is not None and shape != expected:
            raise _fail(where, f"{first.name} is {describe_shape(shape)}; expected "
                               f"{describe_shape(expected)}")
        return shape, max(int(f.name) for f in classes) + 1
    with _open_npz(src, where) as npz:
        kind = _sample_key(npz.files, where)
        shape, dtype = _npy_header(npz.zip, kind, where)
        labels = _labels(npz, where)
    _check_dtype(kind, dtype, where)
    input_shape = _input_shape(kind, shape, expected, where)[0]
    if shape[0] != len(labels):
        raise _fail(where, f"{shape[0]} {kind} but {len(labels)} labels")
    return input_shape, int(labels.max()) + 1 if len(labels) else 0


def write_npz(path: Path, x: np.ndarray, labels: np.ndarray,
              verified: np.ndarray | None = None) -> None:
    """Write samples as an .npz in the accepted format: ``images`` when ``x`` is uint8
    N x C x H x W, else ``features`` (float32), and the ``verified`` mask when given;
    atomically, mode 0644, so that a container's SuperExec user can read it from a
    read-only mount."""
    buf = io.BytesIO()
    x = np.asarray(x)
    arrays = {"images": x} if x.ndim == 4 else {"features": x.astype(np.float32)}
    if verified is not None:
        arrays["verified"] = np.asarray(verified, dtype=bool)
    np.savez(buf, **arrays, labels=np.asarray(labels, dtype=np.int64))
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue(), mode=0o644)


# -- .npz ------------------------------------------------------------------------------
def _existing(path: str, where: str) -> Path:
    src = Path(path)
    if not src.is_absolute():
        raise _fail(where, "is not absolute; give the absolute path of an .npz file or an "
                           "ImageFolder directory")
    if not src.exists():
        raise _fail(where, "does not exist; point it at an .npz file (images or features, "
                           "and labels) or an ImageFolder directory")
    return src


def _open_npz(src: Path, where: str):
    try:
        loaded = np.load(src, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise _fail(where, f"is not a readable .npz file ({err}); write it with "
                           f"{SAVEZ}") from None
    if not isinstance(loaded, np.lib.npyio.NpzFile):
        raise _fail(where, f"holds a single array, not an .npz archive; write it with {SAVEZ}")
    return loaded


def _sample_key(files: list[str], where: str) -> str:
    present = [k for k in ("images", "features") if k in files]
    if len(present) != 1 or "labels" not in files:
        found = "both images and features" if len(present) == 2 else \
            f"arrays {sorted(files)}"
        raise _fail(where, f"holds {found}; it needs 'labels' and exactly one of 'images' "
                           f"or 'features': write it with {SAVEZ}")
    return present[0]


def _npy_header(zf: zipfile.ZipFile, key: str, where: str) -> tuple[tuple[int, ...], np.dtype]:
    """An array's shape and dtype from its .npy header inside the archive."""
    try:
        with zf.open(f"{key}.npy") as fh:
            version = np.lib.format.read_magic(fh)
            read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                    else np.lib.format.read_array_header_2_0)
            shape, _, dtype = read(fh)
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as err:
        raise _fail(where, f"array {key!r} cannot be read ({err}); write it with "
                           f"{SAVEZ}") from None
    return tuple(int(d) for d in shape), np.dtype(dtype)


def _array(npz, key: str, where: str) -> np.ndarray:
    try:
        return npz[key]
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as err:
        raise _fail(where, f"array {key!r} cannot be read ({err}); write it with "
                           f"{SAVEZ}") from None


def _labels(npz, where: str) -> np.ndarray:
    labels = _array(npz, "labels", where)
    if labels.ndim != 1 or not (np.issubdtype(labels.dtype, np.integer)
                                or labels.dtype == bool):
        raise _fail(where, f"labels have shape {labels.shape} and dtype {labels.dtype}; "
                           "store a 1-D integer array of class indices 0..K-1")
    labels = labels.astype(np.int64)
    if len(labels) and labels.min() < 0:
        raise _fail(where, f"label {int(labels.min())} is negative; labels are class "
                           "indices 0..K-1")
    return labels


def _check_dtype(kind: str, dtype: np.dtype, where: str) -> None:
    if kind == "images" and dtype != np.uint8:
        raise _fail(where, f"images have dtype {dtype}; store uint8 pixel values 0..255 "
                           "(numpy: (x * 255).round().astype(numpy.uint8) for floats in "
                           "[0, 1]), or store them as features=")
    if kind == "features" and dtype.kind not in "biuf":
        raise _fail(where, f"features have dtype {dtype}; store real numbers "
                           "(numpy float32 or float64)")


def _input_shape(kind: str, shape: tuple[int, ...], expected: tuple[int, ...] | None,
                 where: str) -> tuple[tuple[int, ...], bool]:
    """(input shape, whether the array is channels-last) of a stored array's shape."""
    if kind == "features":
        if len(shape) != 2:
            raise _fail(where, f"features have shape {shape}; store one row per sample, "
                               "shaped (N, D)")
        found = (shape[1],)
        last = False
    elif len(shape) == 3:
        found, last = (1, shape[1], shape[2]), False
    elif len(shape) == 4:
        found, last = _image_layout(shape, expected, where)
    else:
        raise _fail(where, f"images have shape {shape}; store them shaped (N, H, W), "
                           "(N, C, H, W) or (N, H, W, C)")
    if expected is not None and found != expected:
        raise _fail(where, f"{kind} have shape {shape}, that is {describe_shape(found)}; "
                           f"expected {describe_shape(expected)}")
    return found, last


def _image_layout(shape: tuple[int, ...], expected: tuple[int, ...] | None,
                  where: str) -> tuple[tuple[int, ...], bool]:
    n, a, h, b = shape
    if expected is not None and len(expected) == 3:
        c, eh, ew = expected
        if (a, h, b) == (c, eh, ew):
            return (a, h, b), False
        if (a, h, b) == (eh, ew, c):
            return (b, a, h), True
    if a < b:
        return (a, h, b), False
    if b < a:
        return (b, a, h), True
    raise _fail(where, f"images have shape {shape}: axes 1 and 3 are equal, so the channel "
                       "axis is ambiguous; set input-shape=\"CxHxW\" in the run config "
                       f"(e.g. input-shape=\"{a}x{h}x{b}\" for channels first)")


def _read_npz(src: Path, where: str, expected: tuple[int, ...] | None) -> Samples:
    with _open_npz(src, where) as npz:
        kind = _sample_key(npz.files, where)
        x = _array(npz, kind, where)
        labels = _labels(npz, where)
        verified = _verified(npz, len(labels), where)
        names = _class_names(npz, where)
    _check_dtype(kind, x.dtype, where)
    _, last = _input_shape(kind, x.shape, expected, where)
    if len(labels) != len(x):
        raise _fail(where, f"{len(x)} {kind} but {len(labels)} labels")
    if kind == "features":
        x = np.ascontiguousarray(x, dtype=np.float32)
        bad = ~np.isfinite(x)
        if bad.any():
            row, col = (int(i) for i in np.argwhere(bad)[0])
            raise _fail(where, f"feature {col} of sample {row} is {x[row, col]}; replace "
                               "missing or infinite values before training (e.g. by the "
                               "feature's mean)")
    elif x.ndim == 3:
        x = np.ascontiguousarray(x[:, None])
    else:
        x = np.ascontiguousarray(x.transpose(0, 3, 1, 2) if last else x)
    return Samples(x, labels, verified, names)


def _class_names(npz, where: str) -> tuple[str, ...] | None:
    """The optional ``class_names``: text, one entry per class, in index order."""
    if "class_names" not in npz.files:
        return None
    names = _array(npz, "class_names", where)
    if names.dtype.kind != "U" or names.ndim != 1:
        raise _fail(where, f"'class_names' has shape {names.shape} and dtype {names.dtype}; "
                           "store the class names as a 1-D text array in index order, or "
                           "prepare the data with fedefc data")
    return tuple(str(n) for n in names)


def _verified(npz, n: int, where: str) -> np.ndarray | None:
    """The optional ``verified`` mask: boolean, one entry per label."""
    if "verified" not in npz.files:
        return None
    mask = _array(npz, "verified", where)
    if mask.dtype != bool or mask.shape != (n,):
        raise _fail(where, f"'verified' has shape {mask.shape} and dtype {mask.dtype}; store "
                           f"a boolean array of {n} entries, one per label, True where the "
                           "label was checked")
    return mask


# -- ImageFolder -------------------------------------------------------------------------
def _class_folders(root: Path, where: str) -> list[Path]:
    classes = [p for p in root.iterdir() if p.is_dir() and not p.name.startswith(".")]
    if not classes:
        raise _fail(where, "has no class folders; use the ImageFolder layout <root>/<class "
                           "index>/<image>, e.g. <root>/0/a.png")
    for folder in classes:
        if not folder.name.isdigit():
            raise _fail(where, f"class folder {folder.name!r} is not a class index; name "
                               "the class folders 0, 1, ..., K-1 (the same index for the "
                               "same class on every node)")
    return sorted(classes, key=lambda p: int(p.name))


def _image_files(folder: Path) -> list[Path]:
    return [f for f in sorted(folder.iterdir())
            if f.suffix.lower() in IMAGE_SUFFIXES and not f.name.startswith(".")]


def _decode(file: Path, channels: int | None, where: str) -> np.ndarray:
    """H x W x C uint8 pixels; ``channels`` None: grayscale modes give 1, others 3."""
    try:
        with Image.open(file) as img:
            if channels is None:
                channels = 1 if img.mode in ("1", "L", "I", "I;16", "F") else 3
            pixels = np.asarray(img.convert("L" if channels == 1 else "RGB"), dtype=np.uint8)
    except (OSError, UnidentifiedImageError) as err:
        raise DatasetError(f"{where}: image {str(file)!r} cannot be decoded ({err})") from None
    return pixels.reshape(pixels.shape[0], pixels.shape[1], channels)


def _read_folder(root: Path, where: str, expected: tuple[int, ...] | None) -> Samples:
    if expected is not None and len(expected) != 3:
        raise _fail(where, f"is an image folder, but the run expects "
                           f"{describe_shape(expected)}")
    channels = expected[0] if expected else None
    images, labels = [], []
    for folder in _class_folders(root, where):
        for file in _image_files(folder):
            pixels = _decode(file, channels, where)
            channels = pixels.shape[2]
            shape = (channels, pixels.shape[0], pixels.shape[1])
            want = expected or (shape if not images else (channels, *images[0].shape[:2]))
            if shape != want:
                raise DatasetError(
                    f"{where}: image {str(file)!r} is {pixels.shape[1]}x{pixels.shape[0]} "
                    f"pixels, but the {'run expects' if expected else 'first image is'} "
                    f"{want[2]}x{want[1]}; give every image the same size (resize them, "
                    "e.g. with Pillow's Image.resize, before training)")
            images.append(pixels)
            labels.append(int(folder.name))
    if not images:
        raise _fail(where, f"its class folders hold no image files ({', '.join(IMAGE_SUFFIXES)})")
    return Samples(np.ascontiguousarray(np.stack(images).transpose(0, 3, 1, 2)),
                   np.asarray(labels, dtype=np.int64))
