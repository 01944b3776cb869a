"""The shared building blocks match their definitions (transformers' Llama and torch's linear)."""

import pytest
import torch
import torch.nn.functional as F

from adpfleet.runtime.model import kernels
from adpfleet.runtime.model.layers import Linear, RMSNorm, RotaryEmbedding, linear, rms_norm, silu_and_mul


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


def test_a_linear_weight_written_after_a_forward_is_the_one_the_next_forward_uses():
    layer, x = Linear(64, 96, bias=False), torch.randn(5, 64)
    with torch.inference_mode():
        layer(x)  # prepacks the weight (oneDNN, float32 on the CPU)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(96, 64))  # a reload
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight), atol=1e-5, rtol=1e-5)


def test_the_fused_kernels_compute_the_torch_steps_they_replace_on_strided_views():
    kernels.available() or pytest.skip("kernels not built")
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(7, 4 * 16 + 2 * 2 * 16, generator=g)  # q, k, v of 7 tokens, packed as the layer's output
    q, k = qkv[:, :64].view(7, 4, 16), qkv[:, 64:96].view(7, 2, 16)
    rope = RotaryEmbedding(head_dim=16, max_positions=64, theta=10000.0)(torch.tensor([0, 5, 63, 5, 1, 2, 3]))
    for ours, x in zip(rope(q, k), (q, k)):
        torch.testing.assert_close(ours, rope.rotate(x), atol=1e-6, rtol=1e-6)
    # SiLU x mul with torch's own exp, two vectors at a time and its tail (48 % 32) as torch's loop
    # does: exactly F.silu then the multiply (on a tensor torch does not split between threads)
    gate_up = 4 * torch.randn(300, 2, 48, generator=g).view(300, 96)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(silu_and_mul(gate_up), F.silu(gate) * up)
    norm, x, residual = RMSNorm(32, 1e-6), torch.randn(7, 32, generator=g), torch.randn(7, 32, generator=g)
    norm.weight.data = torch.rand(32, generator=g) + 0.5
    normed, total = norm.add(x, residual)
    assert torch.equal(total, x + residual)  # the residual stream exactly as an unfused add
    torch.testing.assert_close(normed, norm.weight * F.rms_norm(x + residual, (32,), eps=1e-6), atol=2e-6, rtol=2e-6)
