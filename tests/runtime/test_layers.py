"""The shared building blocks match their definitions (transformers' Llama and torch's linear)."""

import pytest
import torch
import torch.nn.functional as F

from adpfleet.runtime.model.layers import RotaryEmbedding, linear, rms_norm


def test_linear_is_x_times_weight_transposed_plus_bias_in_any_layout():
    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(7, 64, generator=g), torch.randn(96, 64, generator=g), torch.randn(96, generator=g)
    torch.testing.assert_close(linear(x, w), F.linear(x, w), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), atol=1e-5, rtol=1e-5)  # qkv bias (Qwen2)
    torch.testing.assert_close(linear(x[:, ::2], w[:, ::2]), F.linear(x[:, ::2], w[:, ::2]), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(linear(x.view(7, 1, 64), w), F.linear(x, w).view(7, 1, 96), atol=1e-5, rtol=1e-5)
    assert linear(x[:0], w).shape == (0, 96)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_the_transformers_definition_exactly(dtype):
    x = torch.randn(5, 3, 32).to(dtype) * 3  # per-head (q/k norm) as well as hidden-state shapes
    weight = torch.rand(32).to(dtype) + 0.5
    h = x.to(torch.float32)
    expected = weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    torch.testing.assert_close(rms_norm(x, weight, 1e-6), expected, atol=2e-6 if dtype == torch.float32 else 0,
                               rtol=2e-6 if dtype == torch.float32 else 0)


def test_rope_of_a_pass_rotates_like_transformers_at_every_position():
    rotary = RotaryEmbedding(head_dim=16, max_positions=64, theta=10000.0)
    positions = torch.tensor([0, 5, 63, 5])
    q, k = torch.randn(4, 4, 16), torch.randn(4, 2, 16)
    rope = rotary(positions)  # gathered once, used by every layer
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    angles = torch.cat([positions[:, None].float() * inv_freq] * 2, dim=-1)[:, None, :]

    def rotate_half(x):
        return torch.cat((-x[..., 8:], x[..., :8]), dim=-1)

    for ours, x in zip(rope(q, k), (q, k)):
        torch.testing.assert_close(ours, x * angles.cos() + rotate_half(x) * angles.sin(), atol=1e-5, rtol=1e-5)
