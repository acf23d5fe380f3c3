"""The trainer's own Triton kernels (CUDA): the loss's two passes (loss.py) and the fp32
master-weight passes (precision.py), launched there, compiled ahead by prebuild.py's helper.

Their names carry explain's categories: "add" elementwise, "adamw" optimizer; the loss's are
found by "cross_entropy".
"""

import triton
import triton.language as tl


@triton.jit
def cross_entropy_forward_kernel(logits_ptr, labels_ptr, lse_ptr, loss_ptr, stride, ignore,
                                 V: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    # per lane: the running maximum and the sum of exp(x - maximum) of what it has read
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    s = tl.zeros([BLOCK], tl.float32)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        x = tl.load(base + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        seen = m_new > float("-inf")  # a lane that has read only padding stays at 0
        s = tl.where(seen, s * tl.exp(m - m_new) + tl.exp(x - m_new), 0.0)
        m = m_new
    row_max = tl.max(m, 0)
    total = tl.sum(tl.where(m > float("-inf"), s * tl.exp(m - row_max), 0.0), 0)
    lse = row_max + tl.log(total)
    label = tl.load(labels_ptr + row)
    counted = label != ignore
    x_label = tl.load(base + tl.where(counted, label, 0)).to(tl.float32)
    tl.store(lse_ptr + row, lse)
    tl.store(loss_ptr + row, tl.where(counted, lse - x_label, 0.0))


@triton.jit
def cross_entropy_backward_kernel(logits_ptr, grad_ptr, labels_ptr, lse_ptr, scale_ptr, stride,
                                  grad_stride, ignore, V: tl.constexpr,
                                  BLOCK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    lse = tl.load(lse_ptr + row)
    label = tl.load(labels_ptr + row)
    scale = tl.where(label != ignore, tl.load(scale_ptr), 0.0)
    for start in range(0, V, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < V
        x = tl.load(logits_ptr + row * stride + offs, mask=mask).to(tl.float32)
        g = (tl.exp(x - lse) - tl.where(offs == label, 1.0, 0.0)) * scale
        tl.store(grad_ptr + row * grad_stride + offs,
                 g.to(grad_ptr.dtype.element_ty), mask=mask)  # fmt: skip


@triton.jit
def grad_add_kernel(acc_ptr, g_ptr, n, ADD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask).to(tl.float32)
    if ADD:
        g += tl.load(acc_ptr + offs, mask=mask)
    tl.store(acc_ptr + offs, g, mask=mask)


@triton.jit
def master_adamw_kernel(p_ptr, g_ptr, m_ptr, v_ptr, copy_ptr, scale_ptr, n, lr, beta1, beta2,
                        eps, decay, step_size, bias2_sqrt, HAS_SCALE: tl.constexpr,
                        HAS_COPY: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    p = tl.load(p_ptr + offs, mask=mask)
    g = tl.load(g_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    if HAS_SCALE:  # the clip, as torch's fused AdamW applies its grad_scale
        g = g / tl.load(scale_ptr)
    p = p * (1.0 - lr * decay)
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) / bias2_sqrt + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if HAS_COPY:
        tl.store(copy_ptr + offs, p.to(copy_ptr.dtype.element_ty), mask=mask)
