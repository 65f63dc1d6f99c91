"""Stateful streaming decode: each stream's decoder state is carried from one chunk to the next, so a chunk
decodes only its new frames and equals the whole-utterance decode up to rounding.

Every layer of the decoder is causal, and what a layer needs from the past is small and fixed:
- a causal conv (kernel k, dilation d) needs the last (k - 1) * d samples of its input;
- a causal transposed conv (kernel 2r, stride r) needs its last input sample (the second half of its kernel
  lands on the next output block);
- an attention layer (sliding window W, RoPE) needs the keys and values of the last W - 1 frames; RoPE is
  relative, so positions are counted inside the window each call (no absolute position to carry).
`DecoderStates` holds these per stream slot on the device ([slots + 1, ...], the last row a scratch slot for
padding rows and one-off decodes); `StatefulDecoder` runs the decoder over a batch of rows, each reading the
state of its slot (zeros for a `fresh` row, exactly the causal zero padding of a stream's start) and writing
back the state after its own valid frames (`lengths`: a row's padding never reaches its state). A fresh row
given left-context frames decodes the context as well, which is the stateless left-context decode: the
engine's fallback when a stream's state is not at hand (docs/code2wav.md).

Both math paths of the decoder run here: its eager modules (CPU, parity) and, when the decoder carries
`fast.FusedVocoderKernels` (its `kernels`), the fused time-major vocoder (`fast.vocoder`), the state filling the
zero columns its kernels write in front of each conv's input. Works inside CUDA graphs: slots, fresh flags and
lengths are device tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from stages.code2wav import state_carry
from stages.code2wav.layers import CausalConv1d, CausalConvTranspose1d, ConvNeXtBlock, ResidualUnit, VocoderBlock
from stages.code2wav.model import Code2WavDecoder
from stages.code2wav.transformer import Attention, PreTransformer
from stages.layers import apply_rotary, rope_cos_sin, rope_inv_freq


def carried_convs(decoder: Code2WavDecoder) -> dict[str, tuple[int, int]]:
    """{state key: (channels, samples)} of every conv that needs input history, in decode order."""
    specs: dict[str, tuple[int, int]] = {"pre_conv": (decoder.pre_conv.conv.in_channels, decoder.pre_conv.left_pad)}
    for i, (up, convnext) in enumerate(decoder.upsample):
        if up.trim:  # the released upsamplers have kernel == stride: no overlap, nothing to carry
            raise ValueError("upsample transposed convs with kernel > stride are not supported")
        specs[f"upsample.{i}"] = (convnext.dwconv.conv.in_channels, convnext.dwconv.left_pad)
    first, *blocks, _act, last = decoder.decoder
    specs["decoder.first"] = (first.conv.in_channels, first.left_pad)
    for b, block in enumerate(blocks):
        _snake, up, *units = block.block
        if up.trim != up.conv.stride[0]:  # kernel 2 x stride: one input sample of history
            raise ValueError("vocoder transposed convs must have kernel == 2 x stride")
        specs[f"decoder.{b}.up"] = (up.conv.in_channels, 1)
        for u, unit in enumerate(units):
            specs[f"decoder.{b}.{u}"] = (unit.conv1.conv.in_channels, unit.conv1.left_pad)
    specs["decoder.last"] = (last.conv.in_channels, last.left_pad)
    return specs


class DecoderStates:
    """Per-slot decoder state on the device: conv input tails, attention K/V of the window, frames of history.

    Row `scratch` (= num_slots) is where padding rows and one-off decodes write; nothing reads it as state.
    """

    def __init__(self, decoder: Code2WavDecoder, num_slots: int):
        if num_slots < 1:
            raise ValueError("num_slots must be >= 1")
        p = next(decoder.parameters())
        cfg = decoder.cfg
        rows = num_slots + 1
        self.num_slots, self.scratch = num_slots, num_slots
        self.window = cfg.sliding_window - 1  # keys a new frame sees besides itself
        self.convs = {key: torch.zeros(rows, c, n, dtype=p.dtype, device=p.device)
                      for key, (c, n) in carried_convs(decoder).items()}
        kv_shape = (cfg.num_hidden_layers, rows, cfg.num_key_value_heads, self.window, cfg.head_dim)
        self.keys = torch.zeros(kv_shape, dtype=p.dtype, device=p.device)  # before RoPE
        self.values = torch.zeros(kv_shape, dtype=p.dtype, device=p.device)
        self.history = torch.zeros(rows, dtype=torch.long, device=p.device)  # valid frames in the K/V window

    @property
    def bytes_per_slot(self) -> int:
        per = sum(t[0].numel() * t.element_size() for t in self.convs.values())
        return per + 2 * self.keys[:, 0].numel() * self.keys.element_size()


class _Rows:
    """The forward's rows: which slot each reads and writes, whether it starts fresh, its valid frames."""

    def __init__(self, states: DecoderStates, slots: torch.Tensor, fresh: torch.Tensor, lengths: torch.Tensor):
        self.states, self.slots, self.lengths = states, slots, lengths
        self.keep = ~fresh  # [B]: read the slot's state (else zeros)

    def read(self, key: str) -> torch.Tensor:  # [B, C, n]
        return _fresh_as_zeros(self.keep, self.states.convs[key].index_select(0, self.slots))

    def write(self, key: str, carried: torch.Tensor, rate: int) -> None:
        """State after each row's valid samples: carried[:, :, L : L + n] with L = lengths * rate."""
        buf = self.states.convs[key]
        buf.index_copy_(0, self.slots, _window(carried, self.lengths * rate, buf.shape[-1]))

    def continued(self, key: str, x: torch.Tensor, rate: int) -> torch.Tensor:
        """x [B, C, T] after the state's n columns, cat(state, x), with the state after the row's valid samples
        saved: a causal conv's input continuing from the state."""
        carried = x.new_empty(*x.shape[:2], self.states.convs[key].shape[-1] + x.shape[-1])
        carried[..., -x.shape[-1]:] = x
        return self.carry_into(key, carried, rate)

    def conv(self, key: str, conv: nn.Conv1d, x: torch.Tensor, rate: int) -> torch.Tensor:
        """Causal conv of x [B, C, T] continuing from the state: conv(cat(state, x)) without padding."""
        return conv(self.continued(key, x, rate))

    def carry_into(self, key: str, padded: torch.Tensor, rate: int) -> torch.Tensor:
        """`padded` [B, C, n + ...] has n columns in front (the zeros the fused SnakeBeta wrote, or unwritten):
        fill them with the state, save the new state, return `padded` (in place)."""
        if state_carry.available(padded.device):  # the same in one kernel launch instead of five
            return state_carry.carry(padded, self.states.convs[key], self.slots, self.keep, self.lengths, rate)
        return self.carry_with_torch_ops(key, padded, rate)

    def carry_with_torch_ops(self, key: str, padded: torch.Tensor, rate: int) -> torch.Tensor:
        n = self.states.convs[key].shape[-1]
        padded[..., :n] = self.read(key)
        self.write(key, padded, rate)
        return padded


def _fresh_as_zeros(keep: torch.Tensor, state: torch.Tensor, batch_dim: int = 0) -> torch.Tensor:
    """`state` with the rows (along `batch_dim`) where `keep` [B] is False zeroed. A select, not a product:
    whatever a slot last held (even inf or NaN) never reaches a fresh row."""
    shape = [1] * state.dim()
    shape[batch_dim] = -1
    return torch.where(keep.view(shape), state, 0)


def _window(x: torch.Tensor, start: torch.Tensor, n: int) -> torch.Tensor:
    """x[b, :, start[b] : start[b] + n] for each row: [B, C, n] (x [B, C, T], start [B] long)."""
    idx = start[:, None] + torch.arange(n, device=x.device)  # [B, n]
    return torch.gather(x, 2, idx[:, None, :].expand(-1, x.shape[1], -1))


class StatefulDecoder:
    """`decoder` over rows of new frames, carrying each row's state in `states` (see the module docstring)."""

    def __init__(self, decoder: Code2WavDecoder, states: DecoderStates, transformer: Callable | None = None):
        """`transformer`: `windowed_transformer` (default) or a compiled version of it (stages/code2wav/compiled.py)."""
        self.decoder, self.states = decoder, states
        self.transformer = transformer or windowed_transformer
        cfg = decoder.cfg
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, states.history.device)
        self.rates = [1]  # samples per frame after each upsampling step, in order
        for r in (*cfg.upsampling_ratios, *cfg.upsample_rates):
            self.rates.append(self.rates[-1] * r)

    def __call__(self, codes: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor,
                 lengths: torch.Tensor) -> torch.Tensor:
        """codes [B, K, T] (right-padded past `lengths`), slots [B] long, fresh [B] bool, lengths [B] long
        -> wav [B, 1, T * samples_per_frame]; the samples of a row's first `lengths` frames are the stream's."""
        dec = self.decoder
        rows = _Rows(self.states, slots, fresh, lengths)
        h = rows.conv("pre_conv", dec.pre_conv.conv, dec.quantizer(codes), 1)
        h = self._transformer(dec.pre_transformer, h.transpose(1, 2), rows).transpose(1, 2)
        rate = 1
        for i, (up, convnext) in enumerate(dec.upsample):
            h = up(h)
            rate *= up.conv.stride[0]
            h = self._convnext(convnext, h, rows, f"upsample.{i}", rate)
        if dec.kernels is not None:  # fused: the state goes into the zero columns before each conv's input
            h = dec.kernels.vocoder(dec.decoder, h, rows.carry_into, rate)
        else:
            h = self._vocoder_eager(h, rows, rate)
        return h.clamp(-1.0, 1.0)

    # ------------------------------------------------------------------ transformer with a K/V window
    def _transformer(self, tf: PreTransformer, x: torch.Tensor, rows: _Rows) -> torch.Tensor:
        """The pre-transformer over the rows' new frames, each row's K/V window read from and written back to its
        slot: the reads and writes are one gather and one scatter over all layers, around `self.transformer`."""
        st = self.states
        y, keys, values, history = self.transformer(
            tf, x, st.keys.index_select(1, rows.slots), st.values.index_select(1, rows.slots),
            st.history.index_select(0, rows.slots), rows.keep, rows.lengths, self.inv_freq)
        st.keys.index_copy_(1, rows.slots, keys)
        st.values.index_copy_(1, rows.slots, values)
        st.history.index_copy_(0, rows.slots, history)
        return y

    # ------------------------------------------------------------------ convolutions
    @staticmethod
    def _convnext(block: ConvNeXtBlock, x: torch.Tensor, rows: _Rows, key: str, rate: int) -> torch.Tensor:
        h = rows.conv(key, block.dwconv.conv, x, rate).transpose(1, 2)
        h = block.pwconv2(F.gelu(block.pwconv1(block.norm(h))))
        return x + (block.gamma * h).transpose(1, 2)

    @staticmethod
    def _up(up: CausalConvTranspose1d, x: torch.Tensor, rows: _Rows, key: str, rate: int,
            bias: torch.Tensor | None) -> torch.Tensor:
        """Transposed conv (kernel 2r, stride r) continuing from the last input sample of the previous chunk.

        With that sample prepended, output block j of the new input is complete; the block of the prepended
        sample (already played) and the incomplete last block are dropped."""
        carried = rows.continued(key, x, rate)  # index `length` of `carried` is the row's last valid input
        r = up.conv.stride[0]
        y = F.conv_transpose1d(carried, up.conv.weight, bias, stride=r)
        return y[..., r:r + x.shape[-1] * r]

    def _vocoder_eager(self, h: torch.Tensor, rows: _Rows, rate: int) -> torch.Tensor:
        first, *blocks, act, last = self.decoder.decoder
        h = rows.conv("decoder.first", first.conv, h, rate)
        for b, block in enumerate(blocks):
            snake, up, *units = block.block
            h = self._up(up, snake(h), rows, f"decoder.{b}.up", rate, up.conv.bias)
            rate *= up.conv.stride[0]
            for u, unit in enumerate(units):
                h = self._unit_eager(unit, h, rows, f"decoder.{b}.{u}", rate)
        return rows.conv("decoder.last", last.conv, act(h), rate)

    @staticmethod
    def _unit_eager(unit: ResidualUnit, x: torch.Tensor, rows: _Rows, key: str, rate: int) -> torch.Tensor:
        h = rows.conv(key, unit.conv1.conv, unit.act1(x), rate)
        return x + unit.conv2(unit.act2(h))


def windowed_transformer(tf: PreTransformer, x: torch.Tensor, past_keys: torch.Tensor, past_values: torch.Tensor,
                         history: torch.Tensor, keep: torch.Tensor, lengths: torch.Tensor,
                         inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pre-transformer over new frames, continuing each row's K/V window. A pure function of tensors (the
    caller reads and writes the states), so that torch.compile can fuse it whole (stages/code2wav/compiled.py).

    x [B, T, latent]; past_keys/values [layers, B, Hkv, W, D] (before RoPE) and history [B] (valid carried frames)
    as the rows' slots hold them, `keep` [B] False where a row starts fresh (its past is zeros), lengths [B] the
    rows' valid new frames. Returns (y [B, T, latent], the windows after each row's valid frames [layers, B, Hkv,
    W, D] x 2, their valid frames [B])."""
    T, W = x.shape[1], past_keys.shape[3]
    history = _fresh_as_zeros(keep, history)
    past_keys, past_values = _fresh_as_zeros(keep, past_keys, 1), _fresh_as_zeros(keep, past_values, 1)
    # window positions: the W carried frames are 0..W-1, the new ones W..W+T-1 (RoPE only sees differences)
    cos, sin = rope_cos_sin(torch.arange(W + T, device=x.device), inv_freq, x.dtype)
    key = torch.arange(W + T, device=x.device)
    query = torch.arange(T, device=x.device)[:, None] + W
    mask = (key <= query) & (key > query - W - 1)  # [T, W + T]: the frame itself and W before it
    mask = (mask & (key >= W - history[:, None, None]))[:, None]  # [B, 1, T, W + T]: carried frames that exist
    # a row's window after its valid frames: positions lengths .. lengths + W - 1 of [past, new]
    after = (lengths[:, None] + torch.arange(W, device=x.device))[:, None, :, None]
    h = tf.input_proj(x)
    keys, values = [], []
    for i, layer in enumerate(tf.layers):
        attn = layer.self_attn
        a, k, v = _window_attention(attn, layer.input_layernorm(h), past_keys[i], past_values[i], cos, sin, mask)
        keys.append(torch.gather(k, 2, after.expand(-1, k.shape[1], -1, k.shape[3])))
        values.append(torch.gather(v, 2, after.expand(-1, v.shape[1], -1, v.shape[3])))
        h = h + layer.self_attn_layer_scale(a)
        h = h + layer.mlp_layer_scale(layer.mlp(layer.post_attention_layernorm(h)))
    y = tf.output_proj(tf.norm(h))
    return y, torch.stack(keys), torch.stack(values), (history + lengths).clamp(max=W)


def _window_attention(attn: Attention, x: torch.Tensor, past_k: torch.Tensor, past_v: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor,
                      mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of the new frames over [past, new] -> (output [B, T, hidden], keys and values [B, Hkv, W + T, D]
    before RoPE)."""
    B, T, _ = x.shape
    H, Hkv, D = attn.num_heads, attn.num_kv_heads, attn.head_dim
    W = past_k.shape[2]
    q = attn.q_proj(x).view(B, T, H, D).transpose(1, 2)
    k = torch.cat([past_k, attn.k_proj(x).view(B, T, Hkv, D).transpose(1, 2)], dim=2)  # [B, Hkv, W + T, D]
    v = torch.cat([past_v, attn.v_proj(x).view(B, T, Hkv, D).transpose(1, 2)], dim=2)
    q, k_rot = apply_rotary(q, cos[W:], sin[W:]), apply_rotary(k, cos, sin)
    v_rep = v
    if Hkv != H:
        k_rot, v_rep = k_rot.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
    out = F.scaled_dot_product_attention(q, k_rot, v_rep, attn_mask=mask, scale=D**-0.5)
    return attn.o_proj(out.transpose(1, 2).reshape(B, T, -1)), k, v


def check_layout(decoder: Code2WavDecoder) -> None:
    """Raise ValueError if the decoder's layers are not the ones `StatefulDecoder` knows how to carry."""
    first, *blocks, act, last = decoder.decoder
    ok = isinstance(first, CausalConv1d) and isinstance(last, CausalConv1d) and all(
        isinstance(b, VocoderBlock) and all(isinstance(u, ResidualUnit) and u.conv2.left_pad == 0
                                            for u in b.block[2:]) for b in blocks)
    if not ok:
        raise ValueError("unexpected decoder layout for stateful decoding")
    carried_convs(decoder)
