"""kit-layout: an fp8 MLA KV layout whose own codec does not write what its spec says.

The layout ``kit_int_fp8`` declares the latent as ``fp8_e4m3`` with one fp32 scale per 128
values, then the rope part in bf16, but its codec (``make_codec``) stores each latent value as
the rounded integer ``round(x / scale)`` (an int8 byte, scale ``amax / 127``) instead of an fp8
e4m3 bit pattern: the bug of ATOM's first fp8 cache. Its own pack and unpack agree with each
other, so only a reader of the spec's regions (another kernel, the kit's ``kv_layout`` check)
sees the wrong values. The plugin registers this layout and nothing else.
"""
