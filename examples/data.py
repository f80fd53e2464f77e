"""CIFAR-10 data for the examples: synthetic (offline default), keras.datasets, or image folders.

`check_source(value)` validates a --data value without TensorFlow (so that bad input fails fast,
with a one-line message); `load(...)` returns (train, test) tf.data datasets of
(float32 images in [0, 1], int32 labels), batched.

Image folders: DIR/<class>/*.jpg (one folder per class; a tenth of the images, chosen by the
seed, become the test set), or DIR/train/<class>/ and DIR/test/<class>/ (the layout of
../shared/data/cifar10-jpeg.tar.gz). A .tar.gz (or .tgz/.tar) of either layout is extracted once
into a cache directory ($TF_RELUPOOL_DATA_CACHE, default ~/.cache/tf_relupool) and reused.
"""
import hashlib
import os
import tarfile

IMAGE_EXTS = (".jpg", ".jpeg", ".png", ".bmp", ".gif")
ARCHIVE_EXTS = (".tar.gz", ".tgz", ".tar")
NUM_CLASSES = 10


class DataError(ValueError):
    """A --data value that cannot be used; the message says why (one line)."""


def _class_dirs(path):
    try:
        return sorted(d for d in os.listdir(path) if os.path.isdir(os.path.join(path, d)))
    except OSError as e:
        raise DataError(f"cannot read {path!r}: {e.strerror}") from None


def _check_class_folders(path):
    classes = _class_dirs(path)
    if len(classes) < 2:
        raise DataError(f"{path!r} is not an image-folder dataset: expected one sub-folder per "
                        f"class (or train/ and test/ with one per class), found "
                        f"{len(classes)} folder(s)")
    for c in classes:
        d = os.path.join(path, c)
        if not any(f.lower().endswith(IMAGE_EXTS) for f in os.listdir(d)):
            raise DataError(f"class folder {d!r} holds no images "
                            f"({', '.join(IMAGE_EXTS)})")
    return classes


def check_folder(path):
    """('split', classes) for DIR/train + DIR/test, ('flat', classes) for DIR/<class>/."""
    subdirs = _class_dirs(path)
    if "train" in subdirs:
        classes = _check_class_folders(os.path.join(path, "train"))
        if "test" in subdirs:
            test_classes = _check_class_folders(os.path.join(path, "test"))
            if test_classes != classes:
                raise DataError(f"{path!r}: train/ and test/ have different class folders")
            return "split", classes
        return "flat", classes  # train/ only: split off a test set from it
    return "flat", _check_class_folders(path)


def is_archive(path):
    return path.lower().endswith(ARCHIVE_EXTS)


def check_source(value):
    """Validates a --data value: "synthetic", "keras", a directory or an archive of one."""
    if value in ("synthetic", "keras"):
        return value
    if not os.path.exists(value):
        raise DataError(f"{value!r} does not exist (use synthetic, keras, an image-folder "
                        f"directory or a .tar.gz of one)")
    if os.path.isdir(value):
        check_folder(value)
        return value
    if is_archive(value):
        if not tarfile.is_tarfile(value):
            raise DataError(f"{value!r} is not a readable tar archive")
        return value
    raise DataError(f"{value!r} is neither a directory nor a .tar.gz/.tgz/.tar archive")


def extract_archive(path):
    """Extracts `path` once into the cache (keyed by its name, size and mtime); returns the root."""
    st = os.stat(path)
    key = hashlib.sha1(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode())
    cache = os.environ.get("TF_RELUPOOL_DATA_CACHE",
                           os.path.join(os.path.expanduser("~"), ".cache", "tf_relupool"))
    root = os.path.join(cache, f"{os.path.basename(path).split('.')[0]}-{key.hexdigest()[:12]}")
    done = os.path.join(root, ".complete")
    if not os.path.exists(done):
        tmp = root + f".tmp{os.getpid()}"
        os.makedirs(tmp, exist_ok=True)
        try:
            with tarfile.open(path) as tar:
                members = [m for m in tar.getmembers()
                           if (m.isfile() or m.isdir()) and not m.name.startswith(("/", ".."))
                           and ".." not in m.name.split("/")]
                tar.extractall(tmp, members=members)
        except (tarfile.TarError, OSError, EOFError) as e:
            raise DataError(f"cannot extract {path!r}: {e}") from None
        entries = [e for e in os.listdir(tmp) if not e.startswith(".")]
        if len(entries) == 1 and os.path.isdir(os.path.join(tmp, entries[0])) and \
                entries[0] not in ("train", "test") and \
                len(_class_dirs(os.path.join(tmp, entries[0]))) >= 2:
            inner = os.path.join(tmp, entries[0])  # archive of one top folder: use it
        else:
            inner = tmp
        if os.path.exists(root):
            import shutil
            shutil.rmtree(root, ignore_errors=True)
        os.rename(inner, root)
        if inner != tmp:
            import shutil
            shutil.rmtree(tmp, ignore_errors=True)
        check_folder(root)
        open(done, "w").close()
    check_folder(root)
    return root


def synthetic(n, seed):
    """CIFAR-shaped, learnable data: a smooth random template per class plus noise, in [0, 1]."""
    import numpy as np
    rng = np.random.default_rng(seed)
    coarse = rng.random((NUM_CLASSES, 8, 8, 3)).astype(np.float32)
    templates = coarse.repeat(4, axis=1).repeat(4, axis=2)  # 32x32x3 blocks of colour
    labels = rng.integers(0, NUM_CLASSES, size=n).astype(np.int32)
    noise = rng.random((n, 32, 32, 3), dtype=np.float32)
    images = 0.6 * templates[labels] + 0.4 * noise
    return images, labels


def _prefetched(ds, prefetch):
    """`ds` with `prefetch` batches made ahead on tf.data's threads; 0: none, every batch is made
    inside the step that reads it (no input-pipeline allocations beside the step's own)."""
    return ds.prefetch(prefetch) if prefetch else ds


def _from_arrays(tf, images, labels, batch_size, shuffle, seed, prefetch):
    ds = tf.data.Dataset.from_tensor_slices((images, labels))
    if shuffle:
        ds = ds.shuffle(len(labels), seed=seed, reshuffle_each_iteration=True)
    return _prefetched(ds.batch(batch_size), prefetch)


def _from_folder(tf, path, subset_classes, batch_size, shuffle, seed, limit, prefetch):
    import keras
    ds = keras.utils.image_dataset_from_directory(
        path, labels="inferred", label_mode="int", class_names=subset_classes,
        image_size=(32, 32), batch_size=None, shuffle=True, seed=seed, verbose=False)
    if limit:
        ds = ds.take(limit)
    # Decode once: keep uint8 in memory (3 KB per image), convert per batch.
    ds = ds.map(lambda x, y: (tf.cast(tf.round(x), tf.uint8), tf.cast(y, tf.int32)))
    ds = ds.cache()
    if shuffle:
        ds = ds.shuffle(10000, seed=seed, reshuffle_each_iteration=True)
    ds = ds.batch(batch_size).map(lambda x, y: (tf.cast(x, tf.float32) / 255.0, y))
    return _prefetched(ds, prefetch)


def load(source, batch_size, limit=None, test_limit=None, seed=0, synthetic_size=(2048, 512),
         prefetch=2):
    """(train, test, description, number of classes) for a checked --data value; `prefetch`
    batches are made ahead of the step that reads them (0: none)."""
    import tensorflow as tf
    if source == "synthetic":
        n_train = limit or synthetic_size[0]
        n_test = test_limit or synthetic_size[1]
        x, y = synthetic(n_train + n_test, seed)
        return (_from_arrays(tf, x[:n_train], y[:n_train], batch_size, True, seed, prefetch),
                _from_arrays(tf, x[n_train:], y[n_train:], batch_size, False, seed, prefetch),
                f"synthetic CIFAR-shaped data ({n_train} train, {n_test} test images)", NUM_CLASSES)
    if source == "keras":
        import keras
        try:
            (x, y), (xt, yt) = keras.datasets.cifar10.load_data()
        except Exception as e:  # no network and no cached copy
            raise DataError(f"keras.datasets.cifar10 could not be loaded ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from None
        x, y = x[:limit] if limit else x, y[:limit, 0] if limit else y[:, 0]
        xt, yt = xt[:test_limit] if test_limit else xt, yt[:test_limit, 0] if test_limit else yt[:, 0]
        to_float = lambda a: a.astype("float32") / 255.0  # noqa: E731
        return (_from_arrays(tf, to_float(x), y.astype("int32"), batch_size, True, seed, prefetch),
                _from_arrays(tf, to_float(xt), yt.astype("int32"), batch_size, False, seed, prefetch),
                f"keras.datasets.cifar10 ({len(y)} train, {len(yt)} test images)", NUM_CLASSES)
    root = extract_archive(source) if is_archive(source) else source
    layout, classes = check_folder(root)
    if layout == "split":
        train_dir, test_dir = os.path.join(root, "train"), os.path.join(root, "test")
        train = _from_folder(tf, train_dir, classes, batch_size, True, seed, limit, prefetch)
        test = _from_folder(tf, test_dir, classes, batch_size, False, seed, test_limit, prefetch)
        return train, test, f"image folders {source} (train/ and test/, {len(classes)} " \
                            f"classes{f', {limit} train images' if limit else ''})", len(classes)
    # One folder per class: every tenth image (in file order) is the test set.
    import keras
    folder = os.path.join(root, "train") if "train" in _class_dirs(root) else root
    full = keras.utils.image_dataset_from_directory(
        folder, labels="inferred", label_mode="int", image_size=(32, 32), batch_size=None,
        shuffle=False, verbose=False).enumerate()
    to_uint8 = lambda i, xy: (tf.cast(tf.round(xy[0]), tf.uint8), tf.cast(xy[1], tf.int32))  # noqa
    train = full.filter(lambda i, xy: i % 10 != 0).map(to_uint8)
    test = full.filter(lambda i, xy: i % 10 == 0).map(to_uint8)
    train = (train.shuffle(100000, seed=seed, reshuffle_each_iteration=False).take(limit)
             if limit else train).cache().shuffle(10000, seed=seed)
    test = (test.take(test_limit) if test_limit else test).cache()
    to_float = lambda x, y: (tf.cast(x, tf.float32) / 255.0, y)  # noqa: E731
    return (_prefetched(train.batch(batch_size).map(to_float), prefetch),
            _prefetched(test.batch(batch_size).map(to_float), prefetch),
            f"image folders {source} ({len(classes)} classes, every tenth image held out)",
            len(classes))
