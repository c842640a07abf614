"""Diffusion policy: the noise schedule, DDIM determinism, and that DDPM training fits a known mapping."""

from __future__ import annotations

import pytest
import torch

from policies.diffusion import DiffusionPolicy, cosine_alpha_bar


def small_policy(**kw) -> DiffusionPolicy:
    args = dict(obs_dim=3, act_dim=2, pred_horizon=4, exec_horizon=2, diffusion_steps=100, ddim_steps=8,
                hidden=64, blocks=2, time_embed=16)
    return DiffusionPolicy(**{**args, **kw})


UNET = dict(denoiser="unet", unet_channels=16, blocks=1)  # the temporal U-Net, small enough for a test


def test_cosine_schedule():
    ab = cosine_alpha_bar(100)
    assert ab.shape == (100,)
    assert (ab[1:] < ab[:-1]).all(), "signal fraction must decrease with t (the floor touches only t = T)"
    assert 0.999 < ab[0] < 1.0 and ab[-1] == pytest.approx(1e-4)  # almost clean at t=1, almost pure noise at T (floor)
    # the cosine schedule's defining property: sqrt(alpha_bar) ~ cos((t/T + s)/(1 + s) * pi/2)
    t = torch.arange(1, 101) / 100
    ref = torch.cos((t + 0.008) / 1.008 * torch.pi / 2) ** 2 / torch.cos(torch.tensor(0.008 / 1.008 * torch.pi / 2)) ** 2
    assert torch.allclose(ab[:99], ref[:99].float(), atol=1e-4)


@pytest.mark.parametrize("kw", [{}, UNET], ids=["mlp", "unet"])
def test_ddim_is_deterministic_in_the_noise(kw):
    torch.manual_seed(0)
    p = small_policy(**kw).eval()
    obs = torch.randn(5, 3)
    w = torch.randn(5, p.latent_dim)
    a1, a2 = p(obs, w), p(obs, w.clone())
    assert a1.shape == (5, 2, 2)
    assert torch.equal(a1, a2), "same (obs, w) must give the same action chunk"
    assert not torch.allclose(p(obs, torch.randn(5, p.latent_dim)), a1), "the noise must matter"
    full = p.sample(obs, w)
    assert full.shape == (5, 4, 2) and torch.equal(full[:, :2], a1), "executed = first exec_horizon of the chunk"


def test_sample_is_deterministic_ddim_over_evenly_spaced_timesteps():
    """sample() is DDIM with eta = 0 (Song et al. 2021, eq. 12 with sigma = 0), its predicted clean chunk
    clipped to the action range and the noise estimate made consistent with the clip, over ddim_steps
    training timesteps evenly spaced from T - 1 down to 0, the last step returning the clean estimate
    (alpha_bar of the step after it is 1): checked against that update written out in float64."""
    torch.manual_seed(0)
    p = small_policy().eval()
    for q in p.denoiser.parameters():  # a denoiser far from zero, so that the clip is active on some entries
        q.data.normal_(0.0, 0.3)
    assert p.ddim_t.tolist() == [99, 85, 71, 57, 42, 28, 14, 0]
    obs, w = torch.randn(6, 3), torch.randn(6, p.latent_dim)
    ab = p.alpha_bar.double()
    x, o, clipped = w.double(), p.obs_norm(obs), 0
    with torch.no_grad():
        steps = [99, 85, 71, 57, 42, 28, 14, 0]
        for i, t in enumerate(steps):
            a, a_next = ab[t], (ab[steps[i + 1]] if i + 1 < len(steps) else torch.tensor(1.0, dtype=torch.float64))
            eps = p.denoiser(x.float(), torch.full((6,), float(t)), o).double()
            x0 = (x - (1 - a).sqrt() * eps) / a.sqrt()
            clipped += int((x0.abs() > 1).sum())
            x0 = x0.clamp(-1.0, 1.0)
            eps = (x - a.sqrt() * x0) / (1 - a).sqrt()
            x = a_next.sqrt() * x0 + (1 - a_next).sqrt() * eps
        got = p.sample(obs, w).reshape(6, -1).double()
    assert clipped > 0, "the reference never clipped: the test would not see the clip's handling"
    assert (got - x).abs().max() < 1e-5


@pytest.mark.parametrize("kw", [dict(hidden=128), UNET], ids=["mlp", "unet"])
def test_ddpm_training_fits_a_known_mapping(kw):
    """Chunk = a fixed function of the observation: after training, DDIM from any noise lands on it."""
    torch.manual_seed(0)
    p = small_policy(**kw)
    obs = torch.rand(4096, 3) * 2 - 1
    target = torch.stack((torch.tanh(obs[:, :1] + obs[:, 1:2]), 0.5 * obs[:, 2:3]), -1).expand(-1, 4, -1).contiguous()
    p.obs_norm.update(obs)
    opt = torch.optim.Adam(p.denoiser.parameters(), lr=2e-3)
    gen = torch.Generator().manual_seed(1)
    for _ in range(1500):
        idx = torch.randint(0, len(obs), (256,), generator=gen)
        loss = p.loss(obs[idx], target[idx], gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        test = torch.rand(256, 3) * 2 - 1
        want = torch.stack((torch.tanh(test[:, :1] + test[:, 1:2]), 0.5 * test[:, 2:3]), -1).expand(-1, 4, -1)
        err = (p.sample(test, torch.randn(256, p.latent_dim)) - want).abs().mean().item()
    assert err < 0.05, f"mean |error| {err:.3f} of the sampled chunk vs the mapping it was trained on"


def test_unet_reads_the_chunk_as_a_sequence():
    """The U-Net's first convolution sees the noisy chunk as [N, A, H] (actions as channels, time
    along the sequence) and its output is flattened back in the chunk's own order, here through 3
    levels (an 8-action chunk halved twice and restored)."""
    torch.manual_seed(0)
    p = small_policy(pred_horizon=8, exec_horizon=8, unet_levels=3, **UNET)
    seen = {}
    p.denoiser.down[0][0].conv1.register_forward_hook(lambda m, inp, out: seen.update(first=inp[0]))
    p.denoiser.out[-1].register_forward_hook(lambda m, inp, out: seen.update(last=out))
    x = torch.randn(2, 16)
    eps = p.denoiser(x, torch.tensor([10, 10]), torch.zeros(2, 3))
    assert torch.equal(seen["first"], x.view(2, 8, 2).transpose(1, 2))
    assert seen["last"].shape == (2, 2, 8) and torch.equal(eps, seen["last"].transpose(1, 2).flatten(1))


@pytest.mark.parametrize("kw, message", [
    (dict(denoiser="transformer"), "denoiser 'transformer': expected one of mlp, unet"),
    (dict(UNET, unet_levels=4), r"pred_horizon \(4\) must be divisible by 2\^\(unet_levels - 1\)"),
    (dict(UNET, unet_channels=12), "unet_channels 12: expected a multiple of 8"),
    (dict(UNET, unet_channels=8, pred_horizon=2, exec_horizon=2), "each GroupNorm group holds 4 values"),
    (dict(UNET, blocks=0), "at least one conv block per level"),
    (dict(time_embed=15), "time_embed 15: expected an even number >= 2"),
    (dict(time_embed=0), "time_embed 0: expected an even number >= 2"),
])
def test_bad_denoiser_settings_are_named(kw, message):
    with pytest.raises(ValueError, match=message):
        small_policy(**kw)
