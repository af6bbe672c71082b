"""The MXFP4 layout of published gpt-oss checkpoints, as constants both directions share.

A quantized tensor ``X`` [*lead, rows, cols] is stored as two uint8 tensors:
- ``X_blocks`` [*lead, rows, cols / 32, 16]: 32 E2M1 (4-bit float) codes per block, two per
  byte, the low nibble first (value 2k in the low 4 bits, value 2k+1 in the high 4 bits);
- ``X_scales`` [*lead, rows, cols / 32]: one E8M0 exponent per block, bias 127: the block's
  values are ``E2M1_VALUES[code] * 2 ** (scale - 127)``.
transformers' reader (``integrations/mxfp4.py``) then transposes the last two dimensions: the
gpt-oss parameter ``gate_up_proj`` [E, hidden, 2 * I] is stored as blocks of [E, 2 * I, hidden].
"""
from __future__ import annotations

# the 16 E2M1 codes: bit 3 is the sign, bits 0-2 index the magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6
E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)
E2M1_MAX = 6.0  # the largest magnitude
BLOCK = 32  # values per block (one shared exponent)
BYTES_PER_BLOCK = BLOCK // 2
SCALE_BIAS = 127  # E8M0: 2 ** (byte - 127); 0xFF is NaN in the OCP MX spec
SCALE_NAN = 0xFF
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"
