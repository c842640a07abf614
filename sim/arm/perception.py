"""Cube position from the depth camera, with Open3D: what ``obs_source=perception`` gives the policy
in place of the simulator's cube position.

Frames and units: world frame z-up (in the arm scene the table top is the plane z = 0), metres,
radians. The camera follows the OpenCV convention (x right, y down, z forward): ``K`` is the 3x3
pinhole intrinsic matrix in pixels (pixel centres at integer coordinates) and ``T_world_cam`` the
4x4 pose of the camera in the world (p_world = T_world_cam @ [p_cam, 1]). Depth images are float
[H, W] z-depth in metres (distance along the optical axis, as MuJoCo and RGB-D sensors give it);
0, NaN, inf and values beyond ``max_depth`` mean no return.

Algorithm (``estimate_cube_position``):
 1. Back-project the depth image to a world-frame point cloud, remembering each point's pixel.
 2. Table: RANSAC plane (Open3D ``segment_plane``, seeded), which must be near horizontal (and near
    ``table_height`` when given). Heights below are distances to this measured plane, so a small
    error in the camera extrinsics tilts the table and the cube together.
 3. Objects: points between ``above_table_margin`` and ``max_object_height`` above the plane (and
    inside ``workspace_xy``), split by DBSCAN (Open3D ``cluster_dbscan``, eps ~2.5 pixels).
 4. The cube is the cluster with a cube-sized near-horizontal face at the height of the cube's top
    (2 half sizes, up to ``max_top_lift`` higher for a cube tipped on an edge). Face test, in the
    image: a pixel in that height range whose image neighbours, one vertical and one horizontal,
    are within ``face_step`` of its height. A wall crossing the height range (arm base, finger,
    link) fails it: one image row down a wall is about a pixel footprint (> 6 mm) lower. Arm
    links and the hand have no upward face in that range, the pick-and-place pad is lower and
    wider, and the goal marker is not in the depth image (ArmEnv.render). Among clusters whose
    face spans at most a cube diagonal plus two pixels, the one with most face pixels wins. Its
    cube points: the points up to the face plane (not the gripper above it) within a half diagonal
    plus a pixel of the face centre.
 5. Centre: the visible points (top face and one or two sides) have their centroid ~h toward the
    camera and ~h/2 above the centre: 18 mm off on the arm scene. Default ``centre="box_fit"``:
    a cube of the known size, started from the top-face plane and a yaw grid, is fitted by
    Levenberg-Marquardt (6 DoF) to (a) the distance of each visible cube point to its surface and
    (b) for table pixels around it, the length of their camera ray inside the cube (the camera
    sees the table there, so the cube is not in the way): (b) bounds the cube where its own edges
    are hidden by the gripper. Points more than ``outlier_distance`` off the fitted surface (a
    finger) are dropped and the fit is repeated. Alternatives measured in BENCHMARKS.md
    ("Cube perception"): ``top_face`` (top-face centroid, one half size down), ``view_shift``
    (centroid moved one half size along the viewing ray), ``centroid``.
 Rejected (``ok=False``, with the reason): no table, nothing on it, no cube-like face, more than
 ``max_hidden_fraction`` of the top face bordering a nearer object above the cube (the gripper),
 or fewer than ``min_fit_fraction`` of the points on the fitted cube.

Assumptions: one cube of known size; it rests on the table, tilted at most ~15 deg (pushing tips
it on an edge; lifted, lying on the pad or held in the gripper it is reported as not found); the
table is the dominant plane of the image; the camera looks at the table from above, so the cube's
top face is visible.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np

try:
    import open3d as o3d
except ImportError as e:  # only the perception code needs Open3D
    raise ImportError(f"sim.arm.perception needs Open3D ({e}): pip install 'open3d>=0.19'") from e


@dataclass
class PerceptionConfig:
    """Estimator parameters (m unless stated). Defaults suit the arm scene's camera (64-96 px,
    45 deg, ~0.85 m from the cube: one pixel covers 6-12 mm there)."""

    max_depth: float = 3.0  # returns farther than this are ignored (the scene's floor is ~1.3 m away)
    min_valid_points: int = 100  # fewer valid depth pixels: no estimate
    plane_distance: float = 0.004  # RANSAC inlier distance to the table plane
    plane_iterations: int = 200  # RANSAC iterations (the table fills most of the image)
    min_plane_normal_z: float = 0.95  # the table normal must be within ~18 deg of world z
    table_height_tolerance: float = 0.03  # |plane height - table_height| allowed when table_height is given
    above_table_margin: float = 0.004  # lower points are table
    max_object_height: float = 0.5  # above the table: the workspace's ceiling
    workspace_xy: tuple[tuple[float, float], tuple[float, float]] | None = None  # ((x0, x1), (y0, y1)), world
    cluster_eps_pixels: float = 2.5  # DBSCAN eps, in pixel footprints at the objects' median distance
    cluster_min_eps: float = 0.01  # lower bound of DBSCAN eps
    cluster_min_points: int = 4  # DBSCAN min_points
    top_face_tolerance: float = 0.003  # thickness of the top face: below 2 half sizes, and off its fitted plane
    max_top_lift: float = 0.012  # how much higher than 2 half sizes the top face may be (cube tipped on an edge)
    face_step: float = 0.004  # max height difference between neighbouring pixels of a face
    min_face_points: int = 3  # fewer face pixels: no cube found
    max_tilt_deg: float = 20.0  # top face more tilted than this from the table: not the cube
    max_hidden_fraction: float = 0.5  # more of the top face next to a nearer, higher object: rejected
    occluder_margin: float = 0.01  # a neighbour this much nearer than a top-face pixel may hide it
    centre: str = "box_fit"  # "box_fit" | "top_face" | "view_shift" | "centroid"
    outlier_distance: float = 0.003  # box_fit refits without points farther off the cube's surface
    min_fit_fraction: float = 0.6  # box_fit: fewer of the cube's points within outlier_distance: rejected
    seed: int = 0  # RANSAC seed (Open3D's global generator): repeatable estimates


@dataclass
class CubeEstimate:
    """One estimate. ``position``: cube centre (3,), world, m (NaN unless ok). ``num_points``: cube
    points used (when not ok: points found above the table, or of the rejected cube). ``yaw``: rad
    about the vertical from world x, folded into [-pi/4, pi/4) by the cube's 90 deg symmetry;
    ``tilt``: angle between the cube's own axis and the table normal, rad (both NaN unless
    ``centre="box_fit"``). ``reason``: why not ok."""

    position: np.ndarray
    num_points: int
    ok: bool
    reason: str = ""
    yaw: float = float("nan")
    tilt: float = float("nan")


def _failed(reason: str, num_points: int = 0) -> CubeEstimate:
    return CubeEstimate(np.full(3, np.nan), num_points, False, reason)


# ================================================================ point cloud
def depth_to_point_cloud(depth: np.ndarray, K: np.ndarray, T_world_cam: np.ndarray,
                         max_depth: float = 3.0) -> o3d.geometry.PointCloud:
    """World-frame point cloud (m) of the valid pixels of a z-depth image (float [H, W], m), in
    row-major pixel order; valid: finite, > 0 and < ``max_depth``.

    Back-projected in NumPy, p_cam = ((u - cx) z / fx, (v - cy) z / fy, z), p = T_world_cam p_cam,
    then wrapped in an Open3D PointCloud, instead of Open3D's ``create_from_depth_image``: the
    estimator needs each point's pixel (its face and occlusion tests look at image neighbours),
    and the two give the same points (tests/test_perception.py checks it to 1e-9 m).
    """
    points, _ = _back_project(depth, K, T_world_cam, max_depth)
    return o3d.geometry.PointCloud(o3d.utility.Vector3dVector(points))


def _back_project(depth, K, T_world_cam, max_depth: float) -> tuple[np.ndarray, np.ndarray]:
    """Points [n, 3] (world, m) and flat row-major pixel indices [n] of the valid pixels."""
    depth = np.asarray(depth, dtype=np.float64)
    K, T = np.asarray(K, dtype=np.float64), np.asarray(T_world_cam, dtype=np.float64)
    if depth.ndim != 2:
        raise ValueError(f"depth must be a 2-D [H, W] image in metres, got shape {depth.shape}")
    if K.shape != (3, 3) or T.shape != (4, 4):
        raise ValueError(f"K must be 3x3 and T_world_cam 4x4, got {K.shape} and {T.shape}")
    with np.errstate(invalid="ignore"):
        valid = np.isfinite(depth) & (depth > 0) & (depth < max_depth)
    pixel = np.flatnonzero(valid)
    v, u = np.divmod(pixel, depth.shape[1])
    z = depth.flat[pixel]
    p_cam = np.stack(((u - K[0, 2]) * z / K[0, 0], (v - K[1, 2]) * z / K[1, 1], z), axis=-1)
    return p_cam @ T[:3, :3].T + T[:3, 3], pixel


# ================================================================ estimator
def estimate_cube_position(depth: np.ndarray, K: np.ndarray, T_world_cam: np.ndarray, cube_half_size: float,
                           config: PerceptionConfig | None = None, table_height: float | None = None) -> CubeEstimate:
    """Centre of the cube (world, m) seen in a z-depth image (module docstring: algorithm and
    assumptions). ``cube_half_size``: m. ``table_height``: world z of the table top (m) if known,
    to reject a wrong dominant plane (e.g. the floor). What the camera sees never raises: an empty
    table, a hidden or tipped-over cube or no table give ``ok=False`` and a reason."""
    cfg = config or PerceptionConfig()
    if cfg.centre not in _CENTRES:
        raise ValueError(f"PerceptionConfig.centre='{cfg.centre}': expected one of {', '.join(_CENTRES)}")
    h = float(cube_half_size)
    depth = np.asarray(depth, dtype=np.float64)
    pts, pixel = _back_project(depth, K, T_world_cam, cfg.max_depth)
    if len(pts) < cfg.min_valid_points:
        return _failed(f"only {len(pts)} valid depth pixels (need {cfg.min_valid_points})")
    cam = np.asarray(T_world_cam, dtype=np.float64)[:3, 3]
    focal = float(np.asarray(K)[0, 0])

    # --- 2. table plane, normal up
    o3d.utility.random.seed(cfg.seed)
    plane, _ = o3d.geometry.PointCloud(o3d.utility.Vector3dVector(pts)).segment_plane(
        cfg.plane_distance, 3, cfg.plane_iterations)
    normal, offset = np.asarray(plane[:3], dtype=np.float64), float(plane[3])
    scale = np.linalg.norm(normal) * (1.0 if normal[2] >= 0 else -1.0)
    normal, offset = normal / scale, offset / scale
    if normal[2] < cfg.min_plane_normal_z:
        return _failed(f"the dominant plane is not horizontal (normal {np.round(normal, 3).tolist()}): "
                       "is the table in view?")
    if table_height is not None and abs(-offset / normal[2] - table_height) > cfg.table_height_tolerance:
        return _failed(f"the dominant plane is at z = {-offset / normal[2]:.3f} m (at x = y = 0), the table top at "
                       f"{table_height:.3f} m: is the table in view?")
    height = pts @ normal + offset  # m above the table plane

    # --- 3. objects on the table
    keep = (height > cfg.above_table_margin) & (height < cfg.max_object_height)
    if cfg.workspace_xy is not None:
        (x0, x1), (y0, y1) = cfg.workspace_xy
        keep &= (pts[:, 0] >= x0) & (pts[:, 0] <= x1) & (pts[:, 1] >= y0) & (pts[:, 1] <= y1)
    if keep.sum() < cfg.min_face_points:
        return _failed(f"nothing on the table ({int(keep.sum())} points higher than "
                       f"{cfg.above_table_margin * 1000:.0f} mm)", int(keep.sum()))
    obj, obj_pixel = pts[keep], pixel[keep]
    footprint = float(np.median(np.linalg.norm(obj - cam, axis=1))) / focal  # m per pixel at the objects
    labels = np.asarray(o3d.geometry.PointCloud(o3d.utility.Vector3dVector(obj)).cluster_dbscan(
        max(cfg.cluster_min_eps, cfg.cluster_eps_pixels * footprint), cfg.cluster_min_points, print_progress=False))

    # --- 4. the cluster with a cube-sized face at the cube's top height
    height_img = np.full(depth.shape, np.nan)
    height_img.flat[pixel] = height
    face = _face_pixels(height_img, 2 * h - cfg.top_face_tolerance, 2 * h + cfg.max_top_lift, cfg.face_step)
    face = face.flat[obj_pixel]
    max_span = 2 * np.sqrt(2) * h + 2 * footprint
    best, best_count, seen = -1, 0, []
    for label in range(int(labels.max()) + 1 if labels.size else 0):
        in_face = (labels == label) & face
        n_face = int(in_face.sum())
        span = _span(obj[in_face]) if n_face >= 2 else 0.0
        seen.append(f"{int((labels == label).sum())} pts, face {n_face} px over {span * 1000:.0f} mm")
        if n_face >= cfg.min_face_points and span <= max_span and n_face > best_count:
            best, best_count = label, n_face
    if best < 0:
        return _failed(f"no cube-sized face {2 * h * 1000:.0f} mm above the table: the cube is hidden, off the "
                       f"table or not upright (clusters: {'; '.join(seen[:5]) or 'none'})", len(obj))
    cluster = labels == best
    face_pts = obj[cluster & face]
    face_centre = face_pts.mean(axis=0)
    up = _plane_normal(face_pts, normal)
    tilt = np.degrees(np.arccos(np.clip(up @ normal, -1.0, 1.0)))
    if tilt > cfg.max_tilt_deg:
        return _failed(f"the cube's top face is tilted {tilt:.0f} deg (at most {cfg.max_tilt_deg:.0f}): tipped over?",
                       int(cluster.sum()))
    # cube points: up to the face plane (higher: the gripper), within a half diagonal of the face centre
    d = obj - face_centre
    above_face = d @ up
    radial = np.linalg.norm(d - np.outer(above_face, up), axis=1)
    part = cluster & (above_face <= cfg.top_face_tolerance) & (radial <= np.sqrt(2) * h + footprint)
    top = part & (np.abs(above_face) <= cfg.top_face_tolerance)

    # Occlusion: a top-face pixel next to a nearer pixel of something higher than the cube.
    higher = np.zeros(depth.shape, dtype=bool)
    higher.flat[pixel] = height > float(np.max(height[keep][top])) + cfg.top_face_tolerance
    hidden = _next_to_nearer(obj_pixel[top], depth, higher, cfg.occluder_margin)
    if hidden.mean() > cfg.max_hidden_fraction:
        return _failed(f"the cube's top face is partly hidden ({int(hidden.sum())} of its {int(top.sum())} pixels "
                       "border something nearer and higher: the gripper?)", int(part.sum()))

    # --- 5. centre; table points around the cube bound it where its edges are hidden
    d = pts - face_centre
    near = np.linalg.norm(d - np.outer(d @ up, up), axis=1) <= np.sqrt(2) * h + 3 * footprint
    free = pts[near & (height <= cfg.above_table_margin)]
    fit = _CENTRES[cfg.centre](obj[part], top[part], up, h, cam, free, cfg)
    if fit.inlier_fraction < cfg.min_fit_fraction:
        return _failed(f"only {fit.inlier_fraction:.0%} of the {int(part.sum())} cube points lie on the fitted cube "
                       "(tipped over or partly hidden?)", int(part.sum()))
    tilt = float("nan") if fit.axis is None else float(np.arccos(np.clip(fit.axis @ normal, -1.0, 1.0)))
    return CubeEstimate(fit.centre, int(part.sum()), True, "", fit.yaw, tilt)


def _face_pixels(height_img: np.ndarray, lo: float, hi: float, step: float) -> np.ndarray:
    """[H, W] bool: height in [lo, hi] and, both vertically and horizontally in the image, at least
    one neighbour also in range and within ``step`` (m) of the pixel's height."""
    with np.errstate(invalid="ignore"):
        in_range = (height_img >= lo) & (height_img <= hi)
    out = in_range.copy()
    for axis in (0, 1):
        agree = np.zeros_like(in_range)
        a, b = [slice(None)] * 2, [slice(None)] * 2
        a[axis], b[axis] = slice(None, -1), slice(1, None)
        a, b = tuple(a), tuple(b)
        with np.errstate(invalid="ignore"):
            pair = in_range[a] & in_range[b] & (np.abs(height_img[a] - height_img[b]) <= step)
        agree[a] |= pair
        agree[b] |= pair
        out &= agree
    return out


def _plane_normal(points: np.ndarray, up: np.ndarray) -> np.ndarray:
    """Unit normal of the least-squares plane through ``points`` [n, 3], on the side of ``up``
    (``up`` itself for fewer than 3 points or points on a line)."""
    if len(points) < 3:
        return up
    _, sv, vt = np.linalg.svd(points - points.mean(axis=0), full_matrices=False)
    if sv[1] < 1e-6:
        return up
    n = vt[2]
    return n if n @ up >= 0 else -n


def _span(points: np.ndarray) -> float:
    """Largest distance between two of the points (m); for more than 1000 points the diagonal of
    their bounding box (an upper bound: a face that large is no cube at these image sizes)."""
    if len(points) > 1000:
        return float(np.linalg.norm(points.max(axis=0) - points.min(axis=0)))
    return float(np.max(np.linalg.norm(points[:, None] - points[None], axis=-1)))


def _next_to_nearer(pixels: np.ndarray, depth: np.ndarray, mask: np.ndarray, margin: float) -> np.ndarray:
    """For flat pixel indices ``pixels``: is one of their 8 image neighbours in ``mask`` and nearer
    to the camera than the pixel by more than ``margin`` (m)?"""
    rows, cols = depth.shape
    v, u = np.divmod(pixels, cols)
    out = np.zeros(len(pixels), dtype=bool)
    for dv in (-1, 0, 1):
        for du in (-1, 0, 1):
            if dv == 0 and du == 0:
                continue
            vv, uu = v + dv, u + du
            inside = (vv >= 0) & (vv < rows) & (uu >= 0) & (uu < cols)
            vv, uu = vv.clip(0, rows - 1), uu.clip(0, cols - 1)
            out |= inside & mask[vv, uu] & (depth[vv, uu] < depth[v, u] - margin)
    return out


# ================================================================ centre estimators
@dataclass
class _Fit:
    centre: np.ndarray  # world, m
    yaw: float = float("nan")  # rad, about the top-face normal
    axis: np.ndarray | None = None  # the cube's own z axis, world (unit)
    inlier_fraction: float = 1.0


# Each takes the cube's points [n, 3] (world, m), which of them are on the top face, the top-face
# normal (unit, up), the half size h, the camera position, table points seen around the cube and
# the config.

def _centre_centroid(p, top, up, h, cam, free, cfg) -> _Fit:
    return _Fit(p.mean(axis=0))


def _centre_view_shift(p, top, up, h, cam, free, cfg) -> _Fit:
    c = p.mean(axis=0)
    return _Fit(c + h * (c - cam) / np.linalg.norm(c - cam))


def _centre_top_face(p, top, up, h, cam, free, cfg) -> _Fit:
    return _Fit(p[top].mean(axis=0) - h * up)


def _centre_box_fit(p, top, up, h, cam, free, cfg) -> _Fit:
    # Fit frame: origin at the top-face centroid, axes e1, e2 in the top face, e3 = up; the cube
    # starts centred h below the origin (its coordinates (0, 0, 0) after the shift in to_frame).
    e1 = np.cross(up, (0.0, 1.0, 0.0)) if abs(up[1]) < 0.9 else np.cross(up, (1.0, 0.0, 0.0))
    e1 /= np.linalg.norm(e1)
    axes = np.stack((e1, np.cross(up, e1), up))  # rows: frame axes in the world
    origin = p[top].mean(axis=0)

    def to_frame(world):
        return (world - origin) @ axes.T + (0.0, 0.0, h)

    q, q_cam = to_frame(p), to_frame(cam[None])[0]
    rays = to_frame(free) - q_cam  # camera -> table points around the cube: the cube is not on these rays

    def residual(x, use):
        rot = _cube_rotation(x)
        return np.concatenate((_surface_distance(q[use], x[:3], rot, h), _chord(q_cam, rays, x[:3], rot, h)))

    # x = (centre (3), yaw, tilt about e1, tilt about e2); yaw started by a grid over the symmetry
    every = np.ones(len(q), dtype=bool)
    cap = (3 * cfg.outlier_distance) ** 2  # outliers (a finger) count at most this in the grid

    def grid_cost(yaw):
        return float(np.minimum(residual(np.array((0.0, 0.0, 0.0, yaw, 0.0, 0.0)), every) ** 2, cap).sum())

    yaws = np.radians(np.arange(0.0, 90.0, 3.0))
    x = np.array((0.0, 0.0, 0.0, yaws[int(np.argmin([grid_cost(y) for y in yaws]))], 0.0, 0.0))
    use = np.abs(_surface_distance(q, x[:3], _cube_rotation(x), h)) <= 3 * cfg.outlier_distance
    for _ in range(2):
        if use.sum() < 3:
            break
        x = _levenberg_marquardt(functools.partial(residual, use=use), x)
        use = np.abs(_surface_distance(q, x[:3], _cube_rotation(x), h)) <= cfg.outlier_distance
    rot = _cube_rotation(x)
    centre = origin + (x[:3] - (0.0, 0.0, h)) @ axes
    cube_up = axes.T @ rot[:, 2]  # the cube's own z axis, world
    yaw = (x[3] + np.pi / 4) % (np.pi / 2) - np.pi / 4
    return _Fit(centre, float(yaw), cube_up, float(use.mean()))


def _cube_rotation(x: np.ndarray) -> np.ndarray:
    """Cube orientation in the fit frame: a tilt (rotation vector (x[4], x[5], 0)) after the yaw x[3]."""
    c, s = np.cos(x[3]), np.sin(x[3])
    yaw = np.array(((c, -s, 0.0), (s, c, 0.0), (0.0, 0.0, 1.0)))
    w = np.array((x[4], x[5], 0.0))
    angle = np.linalg.norm(w)
    if angle < 1e-12:
        return yaw
    k = w / angle
    kx = np.array(((0.0, -k[2], k[1]), (k[2], 0.0, -k[0]), (-k[1], k[0], 0.0)))
    return (np.eye(3) + np.sin(angle) * kx + (1 - np.cos(angle)) * kx @ kx) @ yaw


def _surface_distance(q: np.ndarray, centre: np.ndarray, rot: np.ndarray, h: float) -> np.ndarray:
    """Signed distance (m) of points q [n, 3] (fit frame) to the surface of the cube of half size h
    at ``centre`` with orientation ``rot``; negative inside."""
    local = np.abs((q - centre) @ rot) - h
    return np.linalg.norm(np.maximum(local, 0.0), axis=1) + np.minimum(local.max(axis=1), 0.0)


def _chord(origin: np.ndarray, rays: np.ndarray, centre: np.ndarray, rot: np.ndarray, h: float) -> np.ndarray:
    """Length (m) inside the cube of each segment origin -> origin + ray (fit frame): 0 when the ray
    passes the cube, as every ray that sees the table beside the cube must."""
    o = (origin - centre) @ rot
    d = rays @ rot
    with np.errstate(divide="ignore", invalid="ignore"):
        t1, t2 = (-h - o) / d, (h - o) / d
    t_in = np.nanmax(np.minimum(t1, t2), axis=1).clip(0.0, 1.0)
    t_out = np.nanmin(np.maximum(t1, t2), axis=1).clip(0.0, 1.0)
    return np.maximum(t_out - t_in, 0.0) * np.linalg.norm(rays, axis=1)


def _levenberg_marquardt(residual, x: np.ndarray, iterations: int = 30) -> np.ndarray:
    """Minimise |residual(x)|^2 (finite-difference Jacobian, steps 10 um / 0.1 mrad)."""
    x = np.array(x, dtype=np.float64)
    steps = np.array((1e-5, 1e-5, 1e-5, 1e-4, 1e-4, 1e-4))[:len(x)]
    r = residual(x)
    cost, damping = float(r @ r), 1e-3
    for _ in range(iterations):
        jac = np.empty((len(r), len(x)))
        for k, dx in enumerate(steps):
            xk = x.copy()
            xk[k] += dx
            jac[:, k] = (residual(xk) - r) / dx
        a = jac.T @ jac
        step = -np.linalg.solve(a + damping * np.diag(np.diag(a) + 1e-12), jac.T @ r)
        r_new = residual(x + step)
        if float(r_new @ r_new) < cost:
            x, r, cost, damping = x + step, r_new, float(r_new @ r_new), damping * 0.3
            if np.abs(step[:3]).max() < 1e-7:
                break
        else:
            damping *= 10.0
            if damping > 1e6:
                break
    return x


_CENTRES = {"box_fit": _centre_box_fit, "top_face": _centre_top_face, "view_shift": _centre_view_shift,
            "centroid": _centre_centroid}


# ================================================================ environment glue
def _turn_z(v: np.ndarray, angle: float) -> np.ndarray:
    """The 3-vector ``v`` turned by ``angle`` (rad) about the z axis."""
    c, s = math.cos(angle), math.sin(angle)
    return np.array((c * v[0] - s * v[1], s * v[0] + c * v[1], v[2]))


class Perception:
    """Writes the camera's cube estimate into the cube-position slice (``env.OBJECT_POS``, world, m)
    of the policy observation, env by env: what ``obs_source=perception`` uses instead of the
    simulator's (noisy) cube position. Needs only ``env.depth_image``, ``env.camera_info``,
    ``env.params``, ``env.num_envs`` and ``env.OBJECT_POS``; torch is not imported here.

    When an estimate fails (the gripper hides the cube, ...) the env keeps its last good estimate
    of the current episode, or, before the first one, the cube's nominal start position
    (``CubeParams.start_xy``, resting on the table): never the simulator's true value. A cube in
    the closed gripper cannot be seen (the fingers hide it, and the cluster that holds it is the
    arm's): while the gripper's opening spans a cube (``held_opening``) and the last estimate lies
    at the fingers, the cube is taken to rest where it was last seen until the hand has risen
    ``lift_margin`` above its lowest point since the cube was last seen, and from then on to move
    with the TCP at the offset it had there, turned with the hand about world z, as a planner
    attaches a grasped object to the hand (proprioception: the observation's own TCP position, yaw
    and gripper opening). Without that, a lifted cube read as still on the table: the
    arm_pick_place bench base succeeded 2 % from the estimate against 55 % from the true cube
    (BENCHMARKS.md "Cube perception"). Call
    ``reset(env_ids)`` for envs that start a new episode so that an old estimate is not carried
    over. ``estimates[i]`` is the last estimate of env i, ``failures`` counts failed estimates.
    Needs ``env.TCP_POS``, ``env.TCP_YAW`` and ``env.GRIPPER_OPENING`` (policy-observation slices)
    for the grasp.

        perception = Perception(env)
        obs, _ = env.reset(seed=0)
        perception.reset()
        perception.update(obs["policy"])
        obs, reward, terminated, truncated, info = env.step(action)
        perception.reset(np.flatnonzero((terminated | truncated).cpu().numpy()))
        perception.update(obs["policy"])
    """

    def __init__(self, env, config: PerceptionConfig | None = None):
        self.env = env
        p = env.params
        self.cube_half = p.cube.half
        self.table_height = 0.0  # TableParams: the table top is the world plane z = 0
        (cx, cy), (hx, hy) = p.table.centre_xy, p.table.half_xy
        self.config = config or PerceptionConfig(workspace_xy=((cx - hx, cx + hx), (cy - hy, cy + hy)))
        self.nominal = np.array((*p.cube.start_xy, p.cube.half))
        self.last = np.tile(self.nominal, (env.num_envs, 1))
        # While the gripper holds the cube: the cube minus the TCP when the hand last rested around
        # it, in the hand's yaw frame (world axes turned by the TCP's yaw about z; m), the TCP's lowest
        # height since the grasp hid it (m, world), whether the hand has lifted it since; NaN / False
        # otherwise.
        self.grasp_offset = np.full((env.num_envs, 3), np.nan)
        self.grasp_low_z = np.full(env.num_envs, np.nan)
        self.grasp_lifted = np.zeros(env.num_envs, bool)
        self.seen_tcp = np.full((env.num_envs, 3), np.nan)  # the TCP when the cube was last seen (m, world)
        self.seen_yaw = np.full(env.num_envs, np.nan)  # and its yaw about world z (rad)
        self.lift_margin = 0.005  # m
        # Openings that span the cube: from its width (fingers on two faces) to its face diagonal
        # (across two vertical edges), 5 mm of slack each way (m).
        self.held_opening = (2 * self.cube_half - 0.005, 2 * math.sqrt(2) * self.cube_half + 0.005)
        self.estimates: list[CubeEstimate | None] = [None] * env.num_envs
        self.failures = 0

    def estimate(self, env_index: int) -> CubeEstimate:
        """Estimate from env ``env_index``'s current depth image and the camera pose it believes (the
        calibrated one: the true pose with the episode's calibration error)."""
        depth = self.env.depth_image(env_index)  # the sensor's: with its noise
        K, T_world_cam = self.env.camera_info(env_index)  # the calibrated pose, not the true one
        return estimate_cube_position(depth, K, T_world_cam, self.cube_half, self.config, self.table_height)

    def _release(self, ids) -> None:
        """Envs ``ids`` hold no cube (any more)."""
        self.grasp_offset[ids], self.grasp_low_z[ids], self.grasp_lifted[ids] = np.nan, np.nan, False

    def _at_fingers(self, cube: np.ndarray, tcp: np.ndarray) -> bool:
        """Whether a cube centred at ``cube`` lies between the fingers at ``tcp`` (world, m): within a
        half width of the TCP horizontally and 3 cm vertically. A cube beside the fingers, as a push
        leaves it, is a half width plus a finger (>= 3.3 cm) away; the scripted grasp closes with
        the TCP within a few mm of the cube's centre."""
        return bool(np.linalg.norm(cube[:2] - tcp[:2]) < self.cube_half and abs(cube[2] - tcp[2]) < 0.03)

    def state_dict(self) -> dict:
        """The estimate each env holds while none can be made, its grasp, and the failure count."""
        return {"last": self.last.copy(), "failures": self.failures, "grasp_offset": self.grasp_offset.copy(),
                "grasp_low_z": self.grasp_low_z.copy(), "grasp_lifted": self.grasp_lifted.copy(),
                "seen_tcp": self.seen_tcp.copy(), "seen_yaw": self.seen_yaw.copy()}

    def load_state_dict(self, d: dict) -> None:
        self.last, self.failures = np.array(d["last"], copy=True), d["failures"]
        n = len(self.last)  # checkpoints of older revisions hold no grasp
        self.grasp_offset = np.array(d.get("grasp_offset", np.full((n, 3), np.nan)), copy=True)
        self.grasp_low_z = np.array(d.get("grasp_low_z", np.full(n, np.nan)), copy=True)
        self.grasp_lifted = np.array(d.get("grasp_lifted", np.zeros(n, bool)), copy=True)
        self.seen_tcp = np.array(d.get("seen_tcp", np.full((n, 3), np.nan)), copy=True)
        if "seen_yaw" in d:
            self.seen_yaw = np.array(d["seen_yaw"], copy=True)
        else:  # offsets in world axes (before they turned with the hand): forget them; a held cube is
            self.seen_yaw = np.full(n, np.nan)  # attached again at its next hidden frame
            self.seen_tcp[:] = np.nan
            self._release(np.arange(n))

    def reset(self, env_ids=None) -> None:
        """Forget the last estimate of ``env_ids`` (all envs if None): they start a new episode."""
        ids = np.arange(self.env.num_envs) if env_ids is None else np.asarray(env_ids, dtype=np.int64)
        self.last[ids] = self.nominal
        self.seen_tcp[ids], self.seen_yaw[ids] = np.nan, np.nan
        self._release(ids)
        for i in ids:
            self.estimates[i] = None

    def update(self, policy_obs, env_ids=None) -> np.ndarray:
        """Overwrite ``policy_obs[i, env.OBJECT_POS]`` (torch tensor or NumPy array [N, D], in place)
        for ``env_ids`` (all if None) and return the positions written, [len(env_ids), 3] (world, m)."""
        ids = np.arange(self.env.num_envs) if env_ids is None else np.asarray(env_ids, dtype=np.int64)
        obs = policy_obs.detach().cpu().numpy() if hasattr(policy_obs, "detach") else policy_obs  # a CUDA tensor too
        tcp = np.asarray(obs[:, self.env.TCP_POS], dtype=np.float64)
        yaw = np.asarray(obs[:, self.env.TCP_YAW], dtype=np.float64).reshape(-1)
        opening = np.asarray(obs[:, self.env.GRIPPER_OPENING], dtype=np.float64).reshape(-1)
        for i in ids:
            est = self.estimate(int(i))
            self.estimates[i] = est
            if est.ok:
                self.last[i], self.seen_tcp[i], self.seen_yaw[i] = est.position, tcp[i], yaw[i]
                self._release(i)
                continue
            self.failures += 1
            if not self.held_opening[0] <= opening[i] <= self.held_opening[1]:
                self._release(i)  # released, or never held: the cube stays where it was last placed
                continue
            if np.isnan(self.grasp_low_z[i]):  # the grasp hides the cube (the hand may be rising already)
                seen = not np.isnan(self.seen_tcp[i, 0])
                ref, ref_yaw = (self.seen_tcp[i], self.seen_yaw[i]) if seen else (tcp[i], yaw[i])
                if not self._at_fingers(self.last[i], ref):
                    continue  # closed on something else, or the cube was not between the fingers
                self.grasp_low_z[i], self.grasp_offset[i] = ref[2], _turn_z(self.last[i] - ref, -ref_yaw)
            if not self.grasp_lifted[i]:
                self.grasp_low_z[i] = min(self.grasp_low_z[i], tcp[i, 2])
                if tcp[i, 2] <= self.grasp_low_z[i] + self.lift_margin:  # resting: the hand settles around it
                    self.grasp_offset[i] = _turn_z(self.last[i] - tcp[i], -yaw[i])
                    continue
                self.grasp_lifted[i] = True
            self.last[i] = tcp[i] + _turn_z(self.grasp_offset[i], yaw[i])
        values = self.last[ids]
        if hasattr(policy_obs, "new_tensor"):  # torch: same dtype and device as the observation
            values = policy_obs.new_tensor(values)
        policy_obs[ids, self.env.OBJECT_POS] = values
        return self.last[ids].copy()
