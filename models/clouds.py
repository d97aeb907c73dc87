"""Point clouds sampled from the surfaces of parametric shapes (sphere,
cube, cylinder, cone, torus, pyramid), with per-point part labels: the
NumPy arrays behind the `shapes` data recipe (`hftatf.models.data`).
"""

import numpy as np

# Each shape's parts, in the order of their local part ids. A segmentation
# label is a global part id: the shape's offset (the parts of the shapes
# before it) plus the local id. Parts are geometrically distinct, so that
# they can be told apart after any rotation.
SHAPE_PARTS = {
    "sphere": ("surface",),
    "cube": ("faces",),
    "cylinder": ("side", "caps"),
    "cone": ("side", "base"),
    "torus": ("outer", "inner"),
    "pyramid": ("sides", "base"),
}
SHAPES = tuple(SHAPE_PARTS)


def num_parts(shapes=SHAPES):
    """The number of part labels of a segmentation dataset of `shapes`."""
    return sum(len(SHAPE_PARTS[shape]) for shape in shapes)


def _choose(rng, n, areas):
    """For n points, the index of the surface piece each lies on, with
    probability proportional to the pieces' areas."""
    areas = np.asarray(areas, "float64")
    return rng.choice(len(areas), size=n, p=areas / areas.sum())


def _disc(rng, n, radius):
    """n points uniform on a disc of `radius` in the xy plane."""
    rho = radius * np.sqrt(rng.uniform(size=n))
    theta = rng.uniform(0, 2 * np.pi, n)
    return rho * np.cos(theta), rho * np.sin(theta)


def _sphere(rng, n):
    points = rng.standard_normal((n, 3))
    return points / np.linalg.norm(points, axis=1, keepdims=True), np.zeros(n)


def _cube(rng, n):
    face = rng.integers(6, size=n)
    points = rng.uniform(-1, 1, (n, 3))
    axis = face // 2
    points[np.arange(n), axis] = np.where(face % 2, 1.0, -1.0)
    return points, np.zeros(n)


def _cylinder(rng, n, radius=0.6, height=1.6):
    part = _choose(rng, n, [2 * np.pi * radius * height,
                            2 * np.pi * radius ** 2])
    theta = rng.uniform(0, 2 * np.pi, n)
    side = np.stack([radius * np.cos(theta), radius * np.sin(theta),
                     rng.uniform(-height / 2, height / 2, n)], axis=1)
    x, y = _disc(rng, n, radius)
    caps = np.stack([x, y, np.where(rng.uniform(size=n) < 0.5, -1.0, 1.0)
                     * height / 2], axis=1)
    return np.where(part[:, None] == 0, side, caps), part


def _cone(rng, n, radius=0.8, height=1.6):
    slant = np.hypot(radius, height)
    part = _choose(rng, n, [np.pi * radius * slant, np.pi * radius ** 2])
    # Distance from the apex, as a fraction of the slant: the lateral area
    # within it grows with its square.
    t = np.sqrt(rng.uniform(size=n))
    theta = rng.uniform(0, 2 * np.pi, n)
    side = np.stack([radius * t * np.cos(theta), radius * t * np.sin(theta),
                     height / 2 - height * t], axis=1)
    x, y = _disc(rng, n, radius)
    base = np.stack([x, y, np.full(n, -height / 2)], axis=1)
    return np.where(part[:, None] == 0, side, base), part


def _torus(rng, n, major=0.7, minor=0.3):
    # The area element grows with the distance from the axis,
    # major + minor * cos(v): sample the tube angle v by rejection.
    tube = np.empty(0)
    while tube.size < n:
        v = rng.uniform(0, 2 * np.pi, 2 * n)
        keep = rng.uniform(size=2 * n) < (major + minor * np.cos(v)) / (
            major + minor)
        tube = np.concatenate([tube, v[keep]])
    v = tube[:n]
    u = rng.uniform(0, 2 * np.pi, n)
    ring = major + minor * np.cos(v)
    points = np.stack([ring * np.cos(u), ring * np.sin(u),
                       minor * np.sin(v)], axis=1)
    return points, (np.cos(v) < 0).astype("int64")


def _triangles(rng, corners):
    """One point uniform on each triangle `corners[i]` (`[n, 3, 3]`)."""
    s, t = rng.uniform(size=(2, len(corners), 1))
    flip = s + t > 1
    s, t = np.where(flip, 1 - s, s), np.where(flip, 1 - t, t)
    a, b, c = corners[:, 0], corners[:, 1], corners[:, 2]
    return a + s * (b - a) + t * (c - a)


def _pyramid(rng, n, half_side=0.8, height=1.6):
    face_area = half_side * np.hypot(height, half_side)
    face = _choose(rng, n, [face_area] * 4 + [4 * half_side ** 2])
    h, a = height / 2, half_side
    base = np.array([[-a, -a, -h], [a, -a, -h], [a, a, -h], [-a, a, -h]])
    apex = np.array([0.0, 0.0, h])
    sides = np.stack([np.stack([base[i], base[(i + 1) % 4], apex])
                      for i in range(4)])
    corners = sides[np.minimum(face, 3)]
    points = _triangles(rng, corners)
    x, y = rng.uniform(-a, a, (2, n))
    bottom = np.stack([x, y, np.full(n, -h)], axis=1)
    return np.where(face[:, None] == 4, bottom, points), (face == 4).astype(
        "int64")


_SAMPLERS = {"sphere": _sphere, "cube": _cube, "cylinder": _cylinder,
             "cone": _cone, "torus": _torus, "pyramid": _pyramid}


def _rotation(rng):
    """A rotation matrix drawn uniformly from SO(3)."""
    q, r = np.linalg.qr(rng.standard_normal((3, 3)))
    q = q * np.sign(np.diag(r))
    if np.linalg.det(q) < 0:
        q[:, 0] = -q[:, 0]
    return q


def point_clouds(num_points=256, samples_per_shape=100, noise=0.01,
                 rotate=True, shapes=SHAPES, seed=0):
    """Point clouds sampled from the surfaces of parametric shapes.

    Each cloud is `num_points` points uniform over the surface of one shape,
    centred on its mean, scaled into the unit ball, rotated at random (if
    `rotate`) and moved by Gaussian noise of standard deviation `noise`.

    Returns:
        `(points, labels, parts)`: points `[n, num_points, 3]` float32,
        labels `[n]` int32 (the index of the shape in `shapes`), parts
        `[n, num_points]` int32 (global part ids, see `SHAPE_PARTS`), with
        `n = samples_per_shape * len(shapes)`, in a seeded random order.
    """
    unknown = [shape for shape in shapes if shape not in SHAPE_PARTS]
    if unknown or not shapes:
        raise ValueError(
            f"`shapes` must be a non-empty sequence of {SHAPES}. Received: "
            f"shapes={shapes!r}.")
    if num_points < 1 or samples_per_shape < 1:
        raise ValueError(
            "`num_points` and `samples_per_shape` must be positive. "
            f"Received: num_points={num_points}, "
            f"samples_per_shape={samples_per_shape}.")
    rng = np.random.default_rng(seed)
    clouds, labels, parts = [], [], []
    offset = 0
    for label, shape in enumerate(shapes):
        for _ in range(samples_per_shape):
            points, part = _SAMPLERS[shape](rng, num_points)
            points = points - points.mean(axis=0)
            points = points / np.linalg.norm(points, axis=1).max()
            if rotate:
                points = points @ _rotation(rng).T
            points = points + noise * rng.standard_normal(points.shape)
            clouds.append(points)
            labels.append(label)
            parts.append(offset + part)
        offset += len(SHAPE_PARTS[shape])
    order = rng.permutation(len(labels))
    return (np.asarray(clouds, "float32")[order],
            np.asarray(labels, "int32")[order],
            np.asarray(parts, "int32")[order])
