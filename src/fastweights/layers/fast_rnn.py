"""Fast-weights RNN of Ba, Hinton, Mnih, Leibo & Ionescu, "Using Fast Weights to Attend to the Recent
Past" (NIPS 2016, arXiv 1610.06258).

A ReLU RNN whose hidden state also reads a per-sequence fast weight matrix A, a decaying Hebbian
memory of its own recent hidden states. Tokens x_1..x_T, h_0 = 0, A_0 = 0; for t = 1..T::

    b_t       = W h_{t-1} + C x_t                          boundary term (slow weights W, C)
    h_t^(0)   = f( LN(b_t) )                               preliminary (LN only if ln_preliminary)
    h_t^(s+1) = f( LN(b_t + A_{t-1} h_t^(s)) ),  s = 0..S-1 inner loop: same A_{t-1}, same b_t
    h_t       = h_t^(S)
    A_t       = lam A_{t-1} + eta h_t h_t^T                 write after the inner loop

f = ReLU; LN = layer normalisation of each example over its H units (learned gain and bias,
eps 1e-5). Defaults lam = 0.95, eta = 0.5, S = 1, W initialised to 0.05 I.

Write order (project decision): the read at step t sees only the completed states h_1..h_{t-1};
h_t is written after its own inner loop. At t = 1 the fast term is 0; at t = 2 it is
eta (h_1^T h_2^(s)) h_1. (Public implementations write the preliminary state before reading, or
lag by one step; both are different models.)

Two read forms of the same model:

* ``matrix``: the explicit A [B, H, H] updated every step; O(H^2) per step and an A per step kept
  for backward. :func:`fast_rnn_reference` is this form, written straight from the equations; it
  is also the reference the fast form is tested against.
* ``attention``: unrolling A gives decayed, unnormalised dot-product attention over the past states,
  ``A_{t-1} q = lam^n A_0 q + eta sum_{i=1..n} lam^(n-i) (g_i^T q) g_i`` where g_1..g_n are the
  states written so far (a carried history followed by this call's h_1..h_{t-1}) and A_0 is the
  matrix that summarises everything older. :func:`fast_rnn_attention` never materialises A; its
  hand-written backward pass keeps O(B T H) activations (and read weights, O(B T min(T, H)))
  instead of one A per step, O(B T H^2). The history is folded into A (:func:`fold_history`)
  once it holds ``hidden`` states, so the read stays O(H^2).

Time cannot be parallelised (h_t depends non-linearly on h_{t-1}); only the batch and the read
vectorise. On CPU in fp32/fp64 the attention form runs its time loop in a small C kernel compiled on
first use (``backend="kernel"``, the default where it builds; see "compiled step kernel" below), else
in torch ops (``backend="torch"``); both have hand-written backward passes tested against autograd
through :func:`fast_rnn_reference`. Fast-weight arithmetic runs in fp32 (fp64 if the inputs are
fp64), autocast disabled.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import math
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from fastweights.components import register_mixer
from fastweights.errors import UserError
from fastweights.ops.linear_attention import no_autocast

READ_MODES = ("auto", "matrix", "attention")


# ----------------------------------------------------------------------------- functional forms


def fast_rnn_reference(
    u: Tensor,
    W: Tensor,
    h0: Tensor | None = None,
    A0: Tensor | None = None,
    *,
    lam: float,
    eta: float,
    inner_steps: int = 1,
    ln_weight: Tensor | None = None,
    ln_bias: Tensor | None = None,
    ln_preliminary: bool = True,
    eps: float = 1e-5,
) -> tuple[Tensor, Tensor]:
    """Per-step loop with the explicit fast matrix A, straight from the equations (matrix read).

    Args:
        u: input term C x_t (+ bias) for every step, [B, T, H].
        W: slow recurrent weights [H, H]; the boundary term is ``b_t = W h_{t-1} + u_t``.
        h0: hidden state before the first step [B, H]; None = zeros.
        A0: fast matrix before the first step [B, H, H]; None = zeros.
        lam, eta: decay and fast learning rate of ``A_t = lam A_{t-1} + eta h_t h_t^T``.
        inner_steps: S, the number of fast-weight reads per step (0 = plain (LN-)RNN).
        ln_weight, ln_bias: LayerNorm gain and bias [H]; None = no LayerNorm anywhere.
        ln_preliminary: apply LN to the preliminary vector h^(0) too.
        eps: LayerNorm epsilon.

    Returns:
        hs [B, T, H] (the states h_1..h_T) and A_T [B, H, H].
    """
    B, T, H = u.shape
    h = u.new_zeros(B, H) if h0 is None else h0
    A = u.new_zeros(B, H, H) if A0 is None else A0

    def ln(z: Tensor) -> Tensor:
        return z if ln_weight is None else F.layer_norm(z, (H,), ln_weight, ln_bias, eps)

    outs = []
    for t in range(T):
        b = h @ W.T + u[:, t]
        hs = torch.relu(ln(b) if ln_preliminary else b)
        for _ in range(inner_steps):
            read = (hs.unsqueeze(1) @ A.transpose(1, 2)).squeeze(1)  # A h^(s), as the row h^T A^T (faster on CPU)
            hs = torch.relu(ln(b + read))
        h = hs
        A = lam * A + eta * h.unsqueeze(-1) * h.unsqueeze(-2)  # write after the inner loop
        outs.append(h)
    return torch.stack(outs, 1), A


def fold_history(A: Tensor | None, history: Tensor | None, lam: float, eta: float) -> Tensor | None:
    """Fold stored states g_1..g_n [B, n, H] into the fast matrix: ``lam^n A + eta sum_i lam^(n-i) g_i g_i^T``.

    ``A`` [B, H, H] may be None (zero); returns None when both are None/empty.
    """
    if history is None or history.shape[1] == 0:
        return A
    n = history.shape[1]
    exponents = torch.arange(n - 1, -1, -1, device=history.device, dtype=history.dtype)
    weights = eta * torch.pow(torch.as_tensor(lam, dtype=history.dtype), exponents)  # [n]
    # sum_i w_i g_i g_i^T as one batched matmul: [B, H, n] @ [B, n, H]
    folded = torch.bmm((history * weights[:, None]).transpose(1, 2), history)
    return folded if A is None else folded + (lam**n) * A


def _decay_weights(N: int, lam: float, eta: float, like: Tensor) -> Tensor:
    """rev[N - n + i] = eta lam^(n-1-i): the weight of stored state i in the read after n writes."""
    exponents = torch.arange(N - 1, -1, -1, dtype=like.dtype)
    return (eta * torch.pow(torch.as_tensor(lam, dtype=like.dtype), exponents)).to(like.device)


# ----------------------------------------------------------------------------- compiled step kernel
#
# In torch ops the attention-form recurrence is slow on CPU: each step is ~20 small ops, the two reads are
# memory-bound batched GEMVs over every stored state, and the backward pass adds to every stored state's
# gradient at every step. The kernel below runs the whole time loop in C, one call for the forward pass
# and one for the backward pass. It goes through the batch four examples at a time (the recurrence is
# independent per example), so a group's stored states stay in cache for the whole sequence; W h_{t-1}
# for the four is a register-blocked GEMM; each stored state is read once per read (its dot product
# and its accumulation fused); LayerNorm, ReLU and their backward run in the same pass; the gradients
# reaching older stored states are added once per CHUNK steps as a small GEMM. Rows are padded with
# zeros to whole 64-byte vectors. The arithmetic is the torch implementation's up to the order of sums.
#
# It is plain C (no torch headers), built with the system C compiler on first use (about a second) and
# cached per source, compiler and CPU. Without a compiler, on another device, in another dtype (bf16),
# or with FASTWEIGHTS_FAST_RNN_KERNEL=0, the torch implementation (_AttentionReadRNN) runs instead.

_KERNEL_SOURCE = r"""
#include <math.h>
#include <string.h>
#include <stddef.h>

#define PREFETCH 2 /* backward: steps ahead to fetch the rows saved by the forward pass */
#define CHUNK 32 /* backward: the gradients reaching older stored states are added once per this many steps */

typedef struct {
    int B, T, H, D, Hp, N, L, S, use_ln, prelim_ln;
    double eps, lam;
    void *U, *h0, *Wt, *Wp, *G, *rev, *A0, *lnw, *lnb, *Z, *MU, *RS, *HS, *WS, *WR, *DZC, *DZ, *DB, *dG, *dlnw,
        *dlnb, *ybuf, *scratch;
} Ctx;
"""

_KERNEL_TEMPLATE = r"""
static inline REAL dot_SFX(const REAL *a, const REAL *b, int n) {
    REAL acc = 0;
#pragma omp simd reduction(+:acc)
    for (int j = 0; j < n; j++) acc += a[j] * b[j];
    return acc;
}

static inline void axpy_SFX(REAL *y, REAL a, const REAL *x, int n) {
#pragma omp simd
    for (int j = 0; j < n; j++) y[j] += a * x[j];
}

/* out[i] = scale[i] * (g_i . q) for rows g_0..g_{n-1} of g (D apart), then y += sum_i out[i] g_i; four rows
   at a time, so that four independent FMA chains run and each row is read from L1 the second time */
static void read_SFX(const REAL *g, int n, const REAL *q, const REAL *scale, REAL *out, REAL *y, int D) {
    int i = 0;
    for (; i + 4 <= n; i += 4) {
        const REAL *g0 = g + (size_t)i * D, *g1 = g0 + D, *g2 = g1 + D, *g3 = g2 + D;
        REAL a0 = 0, a1 = 0, a2 = 0, a3 = 0;
#pragma omp simd reduction(+:a0, a1, a2, a3)
        for (int j = 0; j < D; j++) {
            const REAL qj = q[j];
            a0 += g0[j] * qj;
            a1 += g1[j] * qj;
            a2 += g2[j] * qj;
            a3 += g3[j] * qj;
        }
        a0 *= scale[i];
        a1 *= scale[i + 1];
        a2 *= scale[i + 2];
        a3 *= scale[i + 3];
        out[i] = a0;
        out[i + 1] = a1;
        out[i + 2] = a2;
        out[i + 3] = a3;
#pragma omp simd
        for (int j = 0; j < D; j++) y[j] += a0 * g0[j] + a1 * g1[j] + a2 * g2[j] + a3 * g3[j];
    }
    for (; i < n; i++) {
        const REAL *gi = g + (size_t)i * D;
        const REAL w = scale[i] * dot_SFX(gi, q, D);
        out[i] = w;
        axpy_SFX(y, w, gi, D);
    }
}

/* y[b][k] = x[b][k] + sum_{j<H} M[j][k] v[b][j] for b < nb, k < Hp: the matrix-vector products of up to four
   examples as a register-blocked GEMM (two 64-byte vectors of outputs per block, outer products over j). M is
   [H][Hp], Hp a multiple of 32, zero beyond column H; v rows ldv apart, x rows ldx apart (first H entries),
   y [nb][Hp]. */
typedef REAL VEC_SFX __attribute__((vector_size(64)));
#define VL_SFX ((int)(64 / sizeof(REAL)))
static void gemv4_SFX(const REAL *M, int H, int Hp, int nb, const REAL *v, size_t ldv, const REAL *x, size_t ldx,
                      REAL *y) {
    if (nb == 4) {
        const REAL *v0 = v, *v1 = v0 + ldv, *v2 = v1 + ldv, *v3 = v2 + ldv;
        for (int k0 = 0; k0 < Hp; k0 += 2 * VL_SFX) {
            VEC_SFX a00 = {0}, a01 = {0}, a10 = {0}, a11 = {0}, a20 = {0}, a21 = {0}, a30 = {0}, a31 = {0}, m0, m1;
            for (int j = 0; j < H; j++) {
                const REAL *m = M + (size_t)j * Hp + k0, x0 = v0[j], x1 = v1[j], x2 = v2[j], x3 = v3[j];
                memcpy(&m0, m, sizeof m0);
                memcpy(&m1, m + VL_SFX, sizeof m1);
                a00 += x0 * m0;
                a01 += x0 * m1;
                a10 += x1 * m0;
                a11 += x1 * m1;
                a20 += x2 * m0;
                a21 += x2 * m1;
                a30 += x3 * m0;
                a31 += x3 * m1;
            }
            REAL *y0 = y + k0, *y1 = y0 + Hp, *y2 = y1 + Hp, *y3 = y2 + Hp;
            memcpy(y0, &a00, sizeof a00);
            memcpy(y0 + VL_SFX, &a01, sizeof a01);
            memcpy(y1, &a10, sizeof a10);
            memcpy(y1 + VL_SFX, &a11, sizeof a11);
            memcpy(y2, &a20, sizeof a20);
            memcpy(y2 + VL_SFX, &a21, sizeof a21);
            memcpy(y3, &a30, sizeof a30);
            memcpy(y3 + VL_SFX, &a31, sizeof a31);
        }
    } else {
        for (int b = 0; b < nb; b++) {
            REAL *yb = y + (size_t)b * Hp;
            memset(yb, 0, sizeof(REAL) * Hp);
            for (int j = 0; j < H; j++) axpy_SFX(yb, v[b * ldv + j], M + (size_t)j * Hp, Hp);
        }
    }
    for (int b = 0; b < nb; b++) axpy_SFX(y + (size_t)b * Hp, 1, x + b * ldx, H);
}

/* out = relu(LN(z)) (or relu(z)) over H units (row length D, zero beyond H, and so are w, bias and out);
   saves the mean and 1/std */
static void ln_relu_SFX(const REAL *z, REAL *out, REAL *mu, REAL *rs, const REAL *w, const REAL *bias, int H, int D,
                        double eps, int ln) {
    if (!ln) {
        for (int j = 0; j < D; j++) out[j] = z[j] < 0 ? (REAL)0 : z[j];
        return;
    }
    REAL m = 0, v = 0;
#pragma omp simd reduction(+:m)
    for (int j = 0; j < D; j++) m += z[j];
    m /= H;
#pragma omp simd reduction(+:v)
    for (int j = 0; j < D; j++) {
        const REAL d = j < H ? z[j] - m : (REAL)0;
        v += d * d;
    }
    v /= H;
    REAL r = (REAL)(1.0 / sqrt((double)v + eps));
    *mu = m;
    *rs = r;
#pragma omp simd
    for (int j = 0; j < D; j++) {
        REAL a = (z[j] - m) * r * w[j] + bias[j];
        out[j] = a < 0 ? (REAL)0 : a;
    }
}

/* One time step t of the forward pass for examples b0..b1-1; bvec = W h_{t-1} + u_t, rows ldb apart. */
static void fwd_step_SFX(const Ctx *c, int t, int b0, int b1, const REAL *bvec, size_t ldb) {
    const int B = c->B, T = c->T, H = c->H, D = c->D, N = c->N, S = c->S, n = c->L + t;
    REAL *G = (REAL *)c->G, *Z = (REAL *)c->Z, *MU = (REAL *)c->MU, *RS = (REAL *)c->RS;
    REAL *HS = (REAL *)c->HS, *WS = (REAL *)c->WS;
    const REAL *rv = (const REAL *)c->rev + (N - n), *A0 = (const REAL *)c->A0;
    const REAL *lnw = (const REAL *)c->lnw, *lnb = (const REAL *)c->lnb;
    const REAL a0s = (REAL)pow(c->lam, (double)n);
    for (int b = b0; b < b1; b++) {
        const REAL *bb = bvec + (size_t)(b - b0) * ldb, *Gb = G + (size_t)b * N * D;
        for (int s = 0; s <= S; s++) {
            const size_t zi = ((size_t)s * B + b) * T + t;
            REAL *z = Z + zi * D;
            REAL *out = s == S ? G + ((size_t)b * N + n) * D : HS + zi * D;
            memcpy(z, bb, sizeof(REAL) * D);
            if (s > 0) { /* z = b + sum_i ws_i g_i (+ lam^n A0 q), ws_i = rev_i g_i^T q */
                const size_t qi = ((size_t)(s - 1) * B + b) * T + t;
                const REAL *q = HS + qi * D;
                read_SFX(Gb, n, q, rv, WS + qi * N, z, D);
                if (A0) {
                    const REAL *Ab = A0 + (size_t)b * H * H;
                    for (int i = 0; i < H; i++) z[i] += a0s * dot_SFX(Ab + (size_t)i * H, q, H);
                }
            }
            const int ln = s > 0 ? c->use_ln : (c->use_ln && c->prelim_ln);
            ln_relu_SFX(z, out, MU + zi, RS + zi, lnw, lnb, H, D, c->eps, ln);
        }
    }
}

/* One time step t of the backward pass for examples b0..b1-1: dh = dL/dh_t (complete), rows ldh apart.
   Writes dL/db_t into DB (and dL/dz of the reads into DZ if it is kept), adds the LN parameter gradients to
   dlnw and dlnb, and adds this step's contributions to the stored states written since step c0 (the start of
   its chunk) to dG; those to older states wait for chunk_update, with the read weights and dz kept in
   WR and DZC (per example of the group, stage and step of the chunk). */
static void bwd_step_SFX(const Ctx *c, int t, int b0, int b1, const REAL *dh, size_t ldh, int c0) {
    const int B = c->B, T = c->T, H = c->H, D = c->D, N = c->N, S = c->S, n = c->L + t;
    const REAL *G = (const REAL *)c->G, *Z = (const REAL *)c->Z, *MU = (const REAL *)c->MU;
    const REAL *RS = (const REAL *)c->RS, *HS = (const REAL *)c->HS, *WS = (const REAL *)c->WS;
    REAL *WRC = (REAL *)c->WR, *DZC = (REAL *)c->DZC, *DZ = (REAL *)c->DZ, *DB = (REAL *)c->DB, *dG = (REAL *)c->dG;
    REAL *dlnw = (REAL *)c->dlnw, *dlnb = (REAL *)c->dlnb;
    const REAL *rv = (const REAL *)c->rev + (N - n), *A0 = (const REAL *)c->A0, *lnw = (const REAL *)c->lnw;
    const REAL a0s = (REAL)pow(c->lam, (double)n);
    REAL *g = (REAL *)c->scratch, *dz = g + D;
    for (int b = b0; b < b1; b++) {
        const REAL *Gb = G + (size_t)b * N * D;
        REAL *db = DB + ((size_t)b * T + t) * H;
        memset(db, 0, sizeof(REAL) * H);
        memcpy(g, dh + (size_t)(b - b0) * ldh, sizeof(REAL) * D);
        for (int s = S; s >= 0; s--) {
            const size_t zi = ((size_t)s * B + b) * T + t;
            const REAL *out = s == S ? Gb + (size_t)n * D : HS + zi * D;
#pragma omp simd
            for (int j = 0; j < D; j++) g[j] = out[j] <= 0 ? (REAL)0 : g[j]; /* through the ReLU */
            const int ln = s > 0 ? c->use_ln : (c->use_ln && c->prelim_ln);
            if (ln) { /* LayerNorm backward */
                const REAL *z = Z + zi * D, m = MU[zi], r = RS[zi];
                REAL sg = 0, sgx = 0;
#pragma omp simd reduction(+:sg, sgx)
                for (int j = 0; j < D; j++) { /* the pads add 0: g and lnw are zero there */
                    const REAL xh = (z[j] - m) * r, gj = g[j] * lnw[j];
                    sg += gj;
                    sgx += gj * xh;
                    dlnw[j] += g[j] * xh;
                    dlnb[j] += g[j];
                }
                sg /= H;
                sgx /= H;
#pragma omp simd
                for (int j = 0; j < D; j++) dz[j] = r * (g[j] * lnw[j] - sg - (z[j] - m) * r * sgx);
                for (int j = H; j < D; j++) dz[j] = 0;
            } else {
                memcpy(dz, g, sizeof(REAL) * D);
            }
            axpy_SFX(db, 1, dz, H);
            if (s == 0) break;
            /* z = b + sum_i ws_i g_i (+ lam^n A0 q), ws_i = rev_i g_i^T q: back to q and to the g_i */
            const size_t qi = ((size_t)(s - 1) * B + b) * T + t, ci = ((size_t)(b - b0) * S + s - 1) * CHUNK + t - c0;
            const REAL *q = HS + qi * D, *ws = WS + qi * N;
            REAL *wr = WRC + ci * N;
            memcpy(DZC + ci * D, dz, sizeof(REAL) * D); /* for the older states, after the chunk */
            if (DZ) memcpy(DZ + qi * D, dz, sizeof(REAL) * D); /* kept for the gradient of A0 */
            memset(g, 0, sizeof(REAL) * D);
            read_SFX(Gb, n, dz, rv, wr, g, D);
            if (A0) {
                const REAL *Ab = A0 + (size_t)b * H * H;
                for (int i = 0; i < H; i++) axpy_SFX(g, a0s * dz[i], Ab + (size_t)i * H, H);
            }
            REAL *dGb = dG + (size_t)b * N * D;
            for (int i = c->L + c0; i < n; i++) { /* dG_i += ws_i dz + wr_i q for the states of this chunk */
                REAL *dgi = dGb + (size_t)i * D;
                const REAL a = ws[i], w = wr[i];
#pragma omp simd
                for (int j = 0; j < D; j++) dgi[j] += a * dz[j] + w * q[j];
            }
        }
    }
}

/* The forward pass over all T steps, four examples at a time (the recurrence is independent per example,
   so a group's stored states stay in cache for the whole sequence): b_t = W h_{t-1} + u_t, then the step. */
void fwd_seq_SFX(const Ctx *c) {
    const int B = c->B, T = c->T, H = c->H, D = c->D, Hp = c->Hp, N = c->N, L = c->L;
    const REAL *U = (const REAL *)c->U, *h0 = (const REAL *)c->h0, *Wt = (const REAL *)c->Wt;
    REAL *y = (REAL *)c->ybuf, *G = (REAL *)c->G;
    for (int b0 = 0; b0 < B; b0 += 4) {
        const int nb = B - b0 < 4 ? B - b0 : 4;
        for (int t = 0; t < T; t++) {
            const REAL *u = U + ((size_t)b0 * T + t) * H;
            if (t == 0)
                gemv4_SFX(Wt, H, Hp, nb, h0 + (size_t)b0 * H, H, u, (size_t)T * H, y);
            else
                gemv4_SFX(Wt, H, Hp, nb, G + ((size_t)b0 * N + L + t - 1) * D, (size_t)N * D, u, (size_t)T * H, y);
            fwd_step_SFX(c, t, b0, b0 + nb, y, Hp);
        }
    }
}

/* dG_i += sum_{t<C} ws[t][i] dz_t + wr[t][i] q_t for the n0 older stored states i of one example: the
   chunk's contributions as a register-blocked GEMM (four rows, one vector of units at a time). */
static void chunk_update_SFX(REAL *dG, int n0, int D, int C, const REAL *ws, size_t ldws, const REAL *wr,
                             size_t ldwr, const REAL *dz, const REAL *q, size_t ldq) {
    int i = 0;
    for (; i + 4 <= n0; i += 4)
        for (int k0 = 0; k0 < D; k0 += VL_SFX) {
            REAL *r0 = dG + (size_t)i * D + k0, *r1 = r0 + D, *r2 = r1 + D, *r3 = r2 + D;
            VEC_SFX a0, a1, a2, a3, x, y;
            memcpy(&a0, r0, sizeof a0);
            memcpy(&a1, r1, sizeof a1);
            memcpy(&a2, r2, sizeof a2);
            memcpy(&a3, r3, sizeof a3);
            for (int t = 0; t < C; t++) {
                const REAL *w = ws + t * ldws + i, *v = wr + t * ldwr + i;
                memcpy(&x, dz + (size_t)t * D + k0, sizeof x);
                memcpy(&y, q + t * ldq + k0, sizeof y);
                a0 += w[0] * x + v[0] * y;
                a1 += w[1] * x + v[1] * y;
                a2 += w[2] * x + v[2] * y;
                a3 += w[3] * x + v[3] * y;
            }
            memcpy(r0, &a0, sizeof a0);
            memcpy(r1, &a1, sizeof a1);
            memcpy(r2, &a2, sizeof a2);
            memcpy(r3, &a3, sizeof a3);
        }
    for (; i < n0; i++)
        for (int t = 0; t < C; t++) {
            REAL *r = dG + (size_t)i * D;
            const REAL w = ws[t * ldws + i], v = wr[t * ldwr + i], *x = dz + (size_t)t * D, *y = q + t * ldq;
#pragma omp simd
            for (int k = 0; k < D; k++) r[k] += w * x[k] + v * y[k];
        }
}

/* Ask for the rows that the backward pass of step t reads from the forward pass (long out of cache). */
static void prefetch_step_SFX(const Ctx *c, int t, int b0, int b1) {
    const int B = c->B, T = c->T, D = c->D, N = c->N, S = c->S, n = c->L + t;
    const char *Z = (const char *)c->Z, *HS = (const char *)c->HS, *WS = (const char *)c->WS;
    const size_t row = sizeof(REAL) * D;
    for (int b = b0; b < b1; b++)
        for (int s = 0; s <= S; s++) {
            const size_t zi = ((size_t)s * B + b) * T + t;
            for (size_t k = 0; k < row; k += 64) __builtin_prefetch(Z + zi * row + k);
            if (s < S) {
                for (size_t k = 0; k < row; k += 64) __builtin_prefetch(HS + zi * row + k);
                for (size_t k = 0; k < sizeof(REAL) * n; k += 64) __builtin_prefetch(WS + zi * sizeof(REAL) * N + k);
            }
        }
}

/* The backward pass over all T steps, four examples at a time; dG holds dL/dh_t from the output. */
void bwd_seq_SFX(const Ctx *c) {
    const int B = c->B, T = c->T, H = c->H, D = c->D, Hp = c->Hp, N = c->N, L = c->L, S = c->S;
    REAL *y = (REAL *)c->ybuf;
    const REAL *dG = (const REAL *)c->dG, *DB = (const REAL *)c->DB, *Wp = (const REAL *)c->Wp;
    for (int b0 = 0; b0 < B; b0 += 4) {
        const int nb = B - b0 < 4 ? B - b0 : 4;
        for (int t = T - 1; t >= 0; t--) {
            const REAL *dg = dG + ((size_t)b0 * N + L + t) * D;
            if (t == T - 1) { /* dL/dh_T: from the output only */
                memset(y, 0, sizeof(REAL) * (size_t)nb * Hp);
                for (int b = 0; b < nb; b++) axpy_SFX(y + (size_t)b * Hp, 1, dg + (size_t)b * N * D, D);
            } else { /* b_{t+1} = W h_t + u_{t+1}: dL/dh_t also gets W^T dL/db_{t+1} */
                gemv4_SFX(Wp, H, Hp, nb, DB + ((size_t)b0 * T + t + 1) * H, (size_t)T * H, dg, (size_t)N * D, y);
            }
            const int c0 = t - t % CHUNK, n0 = L + c0;
            if (t >= PREFETCH) prefetch_step_SFX(c, t - PREFETCH, b0, b0 + nb);
            bwd_step_SFX(c, t, b0, b0 + nb, y, Hp, c0);
            if (t == c0 && n0 > 0) { /* the chunk's reads -> every older stored state */
                const int C = (T - c0 < CHUNK ? T - c0 : CHUNK);
                for (int b = 0; b < nb; b++)
                    for (int s = 0; s < S; s++) {
                        const size_t qi = ((size_t)s * B + b0 + b) * T + c0, ci = ((size_t)b * S + s) * CHUNK;
                        chunk_update_SFX((REAL *)c->dG + (size_t)(b0 + b) * N * D, n0, D, C,
                                         (const REAL *)c->WS + qi * N, N, (const REAL *)c->WR + ci * N, N,
                                         (const REAL *)c->DZC + ci * D, (const REAL *)c->HS + qi * D, D);
                    }
            }
        }
    }
}
"""


class _KernelCtx(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int) for name in ("B", "T", "H", "D", "Hp", "N", "L", "S", "use_ln", "prelim_ln")] + [
        ("eps", ctypes.c_double),
        ("lam", ctypes.c_double),
    ] + [
        (name, ctypes.c_void_p)
        for name in ("U", "h0", "Wt", "Wp", "G", "rev", "A0", "lnw", "lnb", "Z", "MU", "RS", "HS", "WS", "WR", "DZC",
                     "DZ", "DB", "dG", "dlnw", "dlnb", "ybuf", "scratch")
    ]


_KERNEL_DTYPES = {torch.float32: ("float", "f32"), torch.float64: ("double", "f64")}
_kernel_lib: ctypes.CDLL | None | bool = False  # False: not tried yet; None: unavailable


def _build_kernel() -> ctypes.CDLL | None:
    """Compile (once per source, compiler and CPU; cached on disk) and load the step kernel; None if that fails."""
    source = _KERNEL_SOURCE + "".join(
        _KERNEL_TEMPLATE.replace("REAL", real).replace("_SFX", "_" + sfx) for real, sfx in _KERNEL_DTYPES.values()
    )
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        return None
    base = ["-O3", "-ffp-contract=fast", "-fopenmp-simd", "-fPIC", "-shared", "-std=c99"]
    flag_sets = [base + ["-march=native"], base]  # the second for a compiler or CPU without -march=native
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:  # -march=native: the binary belongs to this CPU
            cpu = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        pass
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "fastweights"
    user = os.getuid() if hasattr(os, "getuid") else 0
    for folder, flags in itertools.product((cache, Path(tempfile.gettempdir()) / f"fastweights-{user}"), flag_sets):
        key = hashlib.sha256("\0".join([source, cc, *flags, platform.machine(), cpu]).encode()).hexdigest()[:16]
        lib_path = folder / f"fast_rnn_kernel_{key}.so"
        try:
            if not lib_path.exists():
                folder.mkdir(parents=True, exist_ok=True)
                with tempfile.TemporaryDirectory(dir=folder) as tmp:
                    src = Path(tmp) / "fast_rnn_kernel.c"
                    src.write_text(source)
                    out = Path(tmp) / lib_path.name
                    subprocess.run([cc, *flags, str(src), "-o", str(out), "-lm"], check=True, capture_output=True,
                                   timeout=120)
                    os.replace(out, lib_path)  # atomic: concurrent builders each install a complete file
            lib = ctypes.CDLL(str(lib_path))
        except (OSError, subprocess.SubprocessError):
            continue
        for sfx in ("f32", "f64"):
            getattr(lib, "fwd_seq_" + sfx).argtypes = [ctypes.c_void_p]
            getattr(lib, "bwd_seq_" + sfx).argtypes = [ctypes.c_void_p]
        return lib
    return None


def step_kernel() -> ctypes.CDLL | None:
    """The compiled step kernel, or None where it cannot be built or FASTWEIGHTS_FAST_RNN_KERNEL=0."""
    global _kernel_lib
    if os.environ.get("FASTWEIGHTS_FAST_RNN_KERNEL", "1") == "0":
        return None
    if _kernel_lib is False:
        _kernel_lib = _build_kernel()
        if _kernel_lib is None:
            warnings.warn("fast_rnn: no C compiler or the step kernel did not build; using the slower torch "
                          "implementation", RuntimeWarning, stacklevel=3)
    return _kernel_lib


class _AttentionReadRNN(torch.autograd.Function):
    """The fast-weights RNN with the attention-form read and a hand-written backward pass.

    Forward and backward are per-step loops of a few fused ops each (addmm, native LayerNorm, two
    bmm for the read); the gradients of W, the LN parameters and A_0 are summed over all steps
    with a single batched op at the end. Past states are kept in one buffer G [B, L + T, H].
    """

    @staticmethod
    def forward(ctx, u, W, ln_weight, ln_bias, h0, A0, history, lam, eta, inner_steps, ln_preliminary, eps):
        B, T, H = u.shape
        L = 0 if history is None else history.shape[1]
        N = L + T
        S = inner_steps
        use_ln = ln_weight is not None
        prelim_ln = use_ln and ln_preliminary
        rev = _decay_weights(N, lam, eta, u)
        G = u.new_empty(B, N, H)  # all states written so far: carried history, then this call's h_t
        if L:
            G[:, :L] = history
        u_steps = u.transpose(0, 1).contiguous()  # [T, B, H] so that each step's slice is contiguous
        # per stage s (0 = preliminary) and step t: LN input, LN mean/rstd, post-ReLU state, read weights
        Z = [[None] * T for _ in range(S + 1)]
        MU = [[None] * T for _ in range(S + 1)]
        RS = [[None] * T for _ in range(S + 1)]
        HS = [[None] * T for _ in range(S + 1)]
        WS = [[None] * T for _ in range(S + 1)]
        h = h0
        W_t = W.t()
        for t in range(T):
            n = L + t  # states written before this step
            b = torch.addmm(u_steps[t], h, W_t)  # W h_{t-1} + C x_t, [B, H]
            z = b
            for s in range(S + 1):
                if s > 0:  # read the fast memory with the previous inner state q
                    q = HS[s - 1][t]
                    z = b
                    if n:
                        Gp = G[:, :n]  # [B, n, H]
                        # row-vector products (q^T G^T, ws^T G): far faster on CPU than G q as a column
                        ws = torch.bmm(q.unsqueeze(1), Gp.transpose(1, 2)).mul_(rev[N - n :])  # [B, 1, n]
                        z = torch.baddbmm(b.unsqueeze(1), ws, Gp).squeeze(1)  # b + sum_i ws_i g_i
                        WS[s][t] = ws
                    if A0 is not None:  # (A0 q)^T = q^T A0^T
                        z = torch.baddbmm(z.unsqueeze(1), q.unsqueeze(1), A0.transpose(1, 2), alpha=lam**n).squeeze(1)
                if (s > 0 and use_ln) or (s == 0 and prelim_ln):
                    a, MU[s][t], RS[s][t] = torch.native_layer_norm(z, (H,), ln_weight, ln_bias, eps)
                else:
                    a = z
                Z[s][t] = z
                if s == S:
                    HS[s][t] = torch.clamp_min(a, 0, out=G[:, n])  # h_t goes straight into the buffer
                else:
                    HS[s][t] = torch.relu(a)
            h = HS[S][t]
        ctx.save_for_backward(u, W, ln_weight, ln_bias, h0, A0)
        ctx.G, ctx.rev, ctx.Z, ctx.MU, ctx.RS, ctx.HS, ctx.WS = G, rev, Z, MU, RS, HS, WS
        ctx.config = (L, lam, S, use_ln, prelim_ln, eps)
        return G[:, L:].clone()

    @staticmethod
    @once_differentiable  # the hand-written backward is not itself differentiable
    def backward(ctx, d_out):
        u, W, ln_weight, ln_bias, h0, A0 = ctx.saved_tensors
        G, rev, Z, MU, RS, HS, WS = ctx.G, ctx.rev, ctx.Z, ctx.MU, ctx.RS, ctx.HS, ctx.WS
        L, lam, S, use_ln, prelim_ln, eps = ctx.config
        B, T, H = u.shape
        N = L + T
        need = ctx.needs_input_grad
        ln_mask = [True, bool(need[2]), bool(need[3])]
        d_lnw = torch.zeros_like(ln_weight) if use_ln else None
        d_lnb = torch.zeros_like(ln_bias) if use_ln else None
        # dG[:, i]: gradient reaching stored state i from the output and from every later read
        dG = torch.cat([u.new_zeros(B, L, H), d_out], 1) if L else d_out.clone()
        dB = [None] * T  # dL/db_t
        a0_terms = []  # (lam^n dL/dr, q) for the A_0 gradient
        db_next = None
        for t in range(T - 1, -1, -1):
            n = L + t
            dh = dG[:, n]
            if db_next is not None:  # b_{t+1} = W h_t + u_{t+1}
                dh = torch.addmm(dh, db_next, W)
            db = None
            for s in range(S, -1, -1):
                if dh is None:  # this stage's state reached the output only through a read of empty memory
                    break
                da = torch.ops.aten.threshold_backward(dh, HS[s][t], 0)  # through the ReLU
                if (s > 0 and use_ln) or (s == 0 and prelim_ln):
                    dz, dw, dbias = torch.ops.aten.native_layer_norm_backward(
                        da, Z[s][t], (H,), MU[s][t], RS[s][t], ln_weight, ln_bias, ln_mask
                    )
                    if dw is not None:
                        d_lnw += dw
                    if dbias is not None:
                        d_lnb += dbias
                else:
                    dz = da
                db = dz if db is None else db + dz
                if s == 0:
                    break
                # z = b + sum_i ws_i g_i (+ lam^n A0 q), ws_i = eta lam^(n-1-i) g_i^T q: back to q and to g_i
                q = HS[s - 1][t]
                dh = None
                if n:
                    Gp = G[:, :n]  # [B, n, H]
                    wr = torch.bmm(dz.unsqueeze(1), Gp.transpose(1, 2)).mul_(rev[N - n :])  # [B, 1, n]
                    dh = torch.bmm(wr, Gp).squeeze(1)
                    # dG_i += ws_i dz + wr_i q
                    dG[:, :n].addcmul_(WS[s][t].transpose(1, 2), dz.unsqueeze(1)).addcmul_(
                        wr.transpose(1, 2), q.unsqueeze(1)
                    )
                if A0 is not None:  # (A0^T dz)^T = dz^T A0
                    dq = torch.bmm(dz.unsqueeze(1), A0).squeeze(1) * lam**n
                    dh = dq if dh is None else dh + dq
                    a0_terms.append((dz * lam**n, q))
            dB[t] = db
            db_next = db
        dB = torch.stack(dB, 1)  # [B, T, H]
        d_u = dB if need[0] else None
        d_W = d_h0 = d_A0 = d_hist = None
        if need[1]:
            h_prev = torch.cat([h0.unsqueeze(1), G[:, L : N - 1]], 1)  # h_{t-1} for every step, [B, T, H]
            d_W = dB.reshape(-1, H).t() @ h_prev.reshape(-1, H)
        if need[4]:
            d_h0 = dB[:, 0] @ W
        if A0 is not None and need[5]:
            if a0_terms:
                dr, q = (torch.stack(x, 1) for x in zip(*a0_terms))  # [B, K, H]
                d_A0 = torch.bmm(dr.transpose(1, 2), q)  # sum_k dr_k q_k^T
            else:
                d_A0 = torch.zeros_like(A0)
        if L and need[6]:
            d_hist = dG[:, :L]
        return d_u, d_W, d_lnw, d_lnb, d_h0, d_A0, d_hist, None, None, None, None, None


_POOL: dict[tuple, list[Tensor]] = {}  # released kernel buffers by (numel, dtype, device)


def _workspace(like: Tensor, *shape: int) -> Tensor:
    """An uninitialised buffer, one released by an earlier backward pass where there is one of this size
    (fresh memory costs a page fault per 4 KiB on first touch, a tenth of the layer's time here)."""
    stack = _POOL.get((math.prod(shape), like.dtype, like.device))
    return stack.pop().view(shape) if stack else like.new_empty(shape)


class _Recycle:
    """An object that lives as long as the autograd context holding it (a handle for weakref.finalize)."""


def _release(*buffers: Tensor) -> None:
    for x in buffers:
        stack = _POOL.setdefault((x.numel(), x.dtype, x.device), [])
        if len(stack) < 16:
            stack.append(x.view(-1))


class _AttentionReadRNNKernel(torch.autograd.Function):
    """:class:`_AttentionReadRNN` with the time loop in the compiled kernel (CPU, fp32/fp64).

    The forward and the backward pass are one kernel call each, which runs the whole sequence for
    four examples at a time (``W h_{t-1}`` for the four, then each one's step). Activations are kept
    in buffers indexed [stage, example, step, ...].
    """

    @staticmethod
    def forward(ctx, u, W, ln_weight, ln_bias, h0, A0, history, lam, eta, inner_steps, ln_preliminary, eps):
        B, T, H = u.shape
        L = 0 if history is None else history.shape[1]
        N, S = L + T, inner_steps
        D, Hp = -(-H // 16) * 16, -(-H // 32) * 32  # rows padded with zeros to whole vectors; W to whole blocks
        use_ln = ln_weight is not None
        G = _workspace(u, B, N, D)  # all states written so far: carried history, then this call's h_t
        if L:  # (the kernel writes whole rows of this call's states, zero beyond H)
            G[:, :L, H:] = 0
            G[:, :L, :H] = history
        Wt, Wp, ln = u.new_zeros(H, Hp), u.new_zeros(H, Hp), u.new_zeros(2, D)
        Wt[:, :H], Wp[:, :H] = W.t(), W  # h W^T (forward) and db W (backward) as rows of outer products
        if use_ln:
            ln[0, :H], ln[1, :H] = ln_weight, ln_bias
        buf = dict(
            U=u.contiguous(), h0=h0.contiguous(), Wt=Wt, Wp=Wp, G=G, rev=_decay_weights(N, lam, eta, u),
            A0=None if A0 is None else A0.contiguous(), lnw=ln[0], lnb=ln[1],
            Z=_workspace(u, S + 1, B, T, D),  # LN input of every stage (stage 0: b_t)
            MU=u.new_zeros(S + 1, B, T), RS=u.new_zeros(S + 1, B, T),  # LN mean and 1/std
            HS=_workspace(u, S, B, T, D),  # outputs of stages 0..S-1 (stage S is h_t, in G)
            WS=_workspace(u, S, B, T, N),  # read weights rev_i g_i^T q of every stage and step
            ybuf=u.new_empty(4, Hp),
        )
        kctx = _KernelCtx(B=B, T=T, H=H, D=D, Hp=Hp, N=N, L=L, S=S, use_ln=int(use_ln),
                          prelim_ln=int(bool(ln_preliminary)), eps=float(eps), lam=float(lam),
                          **{k: (None if v is None else v.data_ptr()) for k, v in buf.items()})
        getattr(step_kernel(), "fwd_seq_" + _KERNEL_DTYPES[u.dtype][1])(ctypes.addressof(kctx))
        ctx.save_for_backward(W)
        ctx.buf, ctx.kctx, ctx.config = buf, kctx, (L, H, lam, S, use_ln)
        ctx.recycle = _Recycle()  # when the graph (and ctx) is freed, its buffers go back to the pool
        weakref.finalize(ctx.recycle, _release, G, buf["Z"], buf["HS"], buf["WS"])
        return G[:, L:, :H].clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, d_out):
        (W,) = ctx.saved_tensors
        buf, kctx = ctx.buf, ctx.kctx
        L, H, lam, S, use_ln = ctx.config
        G, WS, HS, A0 = buf["G"], buf["WS"], buf["HS"], buf["A0"]
        B, N, D = G.shape
        T = N - L
        need = ctx.needs_input_grad
        dG = _workspace(G, B, N, D)  # gradient reaching each stored state (from the output and from later reads)
        dG[:, :L], dG[:, L:, H:] = 0, 0
        dG[:, L:, :H] = d_out
        WR, DZC = G.new_empty(4, S, _CHUNK, N), G.new_empty(4, S, _CHUNK, D)  # a chunk's read weights and dz
        DZ = None if A0 is None else G.new_empty(S, B, T, D)  # dL/dz of every read, for the gradient of A0
        DB = G.new_empty(B, T, H)  # dL/db_t = dL/du_t
        d_ln = G.new_zeros(2, D)  # LayerNorm gain and bias gradients, summed over all steps by the kernel
        scratch = G.new_empty(2, D)
        for k, v in dict(WR=WR, DZC=DZC, DZ=DZ, DB=DB, dG=dG, dlnw=d_ln[0], dlnb=d_ln[1], scratch=scratch).items():
            setattr(kctx, k, None if v is None else v.data_ptr())
        getattr(step_kernel(), "bwd_seq_" + _KERNEL_DTYPES[G.dtype][1])(ctypes.addressof(kctx))
        d_u = DB if need[0] else None
        d_W = d_h0 = d_A0 = d_hist = None
        if need[1]:
            h_prev = torch.cat([buf["h0"].unsqueeze(1), G[:, L : N - 1, :H]], 1)  # h_{t-1} for every step
            d_W = DB.reshape(-1, H).t() @ h_prev.reshape(-1, H)
        d_lnw = d_ln[0, :H] if use_ln and need[2] else None
        d_lnb = d_ln[1, :H] if use_ln and need[3] else None
        if need[4]:
            d_h0 = DB[:, 0] @ W
        if A0 is not None and need[5]:  # sum over steps and stages of lam^n dz q^T
            scale = torch.pow(torch.as_tensor(lam, dtype=G.dtype), torch.arange(L, N, dtype=G.dtype)).to(G.device)
            dz = (DZ[..., :H] * scale[:, None]).permute(1, 0, 2, 3).reshape(B, S * T, H)
            d_A0 = torch.bmm(dz.transpose(1, 2), HS[..., :H].permute(1, 0, 2, 3).reshape(B, S * T, H))
        if L and need[6]:
            d_hist = dG[:, :L, :H].clone()
        _release(dG)
        return d_u, d_W, d_lnw, d_lnb, d_h0, d_A0, d_hist, None, None, None, None, None


_CHUNK = 32  # CHUNK in the kernel source


BACKENDS = ("auto", "kernel", "torch")


def _recurrence(*, lam: float, eta: float, inner_steps: int = 1, ln_weight: Tensor | None = None,
                ln_bias: Tensor | None = None, ln_preliminary: bool = True, eps: float = 1e-5) -> tuple:
    """The keyword arguments of :func:`fast_rnn_reference` that set the recurrence, checked and in order."""
    if ln_weight is not None and ln_bias is None:
        ln_bias = torch.zeros_like(ln_weight)
    return ln_weight, ln_bias, float(lam), float(eta), int(inner_steps), bool(ln_preliminary), float(eps)


def kernel_applies(*tensors: Tensor | None) -> bool:
    """Whether the compiled step kernel can run these inputs: CPU tensors of one dtype, fp32 or fp64."""
    present = [x for x in tensors if x is not None]
    dtype = present[0].dtype
    return (
        dtype in _KERNEL_DTYPES
        and all(x.device.type == "cpu" and x.dtype == dtype for x in present)
        and step_kernel() is not None
    )


def fast_rnn_attention(
    u: Tensor,
    W: Tensor,
    h0: Tensor | None = None,
    A0: Tensor | None = None,
    history: Tensor | None = None,
    *,
    backend: str = "auto",
    **recurrence,
) -> Tensor:
    """The fast-weights RNN with the attention-form read (A never materialised); same model as
    :func:`fast_rnn_reference`.

    Args:
        u, W, h0: as in :func:`fast_rnn_reference`.
        A0: fast matrix [B, H, H] summarising everything older than ``history``; None = zeros.
        history: states written before this call and not folded into A0, oldest first,
            [B, L, H]; None = none. The memory before step t is
            ``fold_history(A0, cat(history, h_1..h_{t-1}))``.
        backend: "kernel" (each step's inner loop in the compiled C kernel; CPU, fp32/fp64), "torch"
            (torch ops only), or "auto" (the kernel where it applies, else torch).
        recurrence: the keyword arguments of :func:`fast_rnn_reference` (lam, eta, inner_steps,
            ln_weight, ln_bias, ln_preliminary, eps).

    Returns:
        hs [B, T, H]. The memory after the call is ``fold_history(A0, cat(history, hs))``.
    """
    if backend not in BACKENDS:
        raise ValueError(f"fast_rnn_attention: backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    ln_weight, ln_bias, *config = _recurrence(**recurrence)
    B, T, H = u.shape
    if h0 is None:
        h0 = u.new_zeros(B, H)
    if history is not None and history.shape[1] == 0:
        history = None
    inputs = (u, W, ln_weight, ln_bias, h0, A0, history)
    use_kernel = backend == "kernel" or (backend == "auto" and kernel_applies(*inputs))
    if use_kernel and not kernel_applies(*inputs):
        raise ValueError("fast_rnn_attention: the step kernel needs CPU fp32/fp64 inputs of one dtype and a C compiler")
    function = _AttentionReadRNNKernel if use_kernel else _AttentionReadRNN
    return function.apply(*inputs, *config)


# ----------------------------------------------------------------------------- module


class FastRNNState(NamedTuple):
    """State of :class:`FastWeightRNN` between calls.

    h: last hidden state [B, H]. A: fast matrix [B, H, H] summarising every written state older
    than ``history`` (None = zero). history: the most recent written states not yet folded into A,
    oldest first, [B, L, H] (None = none). The matrix read keeps history None; the attention read
    keeps up to ``hidden`` states there and folds them into A when full.
    """

    h: Tensor
    A: Tensor | None
    history: Tensor | None


class FastWeightRNN(nn.Module):
    """Fast-weights RNN layer on the state protocol: ``hs, state = rnn(x, state=None)``.

    Args:
        input_size: features of x.
        hidden: H, the number of hidden units.
        lam, eta: fast-weight decay and learning rate (0.95, 0.5).
        inner_steps: S >= 1 inner-loop reads per step (1).
        layer_norm: LayerNorm before every ReLU (True).
        ln_preliminary: LayerNorm on the preliminary vector h^(0) as well (True).
        fast_weights: False gives the plain (LN-)RNN h_t = f(LN(W h_{t-1} + C x_t)) (True).
        read_mode: "matrix", "attention", or "auto": the matrix for single-step calls without
            autograd (token-by-token generation), attention otherwise; the choices measured faster
            in benchmarks/bench_fast_rnn.py (training at T/H from 1/4 to 16, generation at T = 1).
        eps: LayerNorm epsilon (1e-5).

    forward(x [B, T, input_size], state: FastRNNState | None) -> (hs [B, T, H], FastRNNState).
    """

    def __init__(
        self,
        input_size: int,
        hidden: int,
        lam: float = 0.95,
        eta: float = 0.5,
        inner_steps: int = 1,
        layer_norm: bool = True,
        ln_preliminary: bool = True,
        fast_weights: bool = True,
        read_mode: str = "auto",
        eps: float = 1e-5,
    ):
        super().__init__()
        if hidden < 1:
            raise UserError(f"fast_rnn: hidden must be >= 1, got {hidden}")
        if not 0.0 <= lam <= 1.0:
            raise UserError(f"fast_rnn: lam must be in [0, 1], got {lam}")
        if eta < 0:
            raise UserError(f"fast_rnn: eta must be >= 0, got {eta}")
        if inner_steps < 1:
            raise UserError(f"fast_rnn: inner_steps must be >= 1, got {inner_steps}")
        if read_mode not in READ_MODES:
            raise UserError(f"fast_rnn: read_mode must be one of {', '.join(READ_MODES)}, got {read_mode!r}")
        self.hidden, self.lam, self.eta, self.inner_steps = hidden, lam, eta, inner_steps
        self.ln_preliminary, self.fast_weights, self.read_mode, self.eps = ln_preliminary, fast_weights, read_mode, eps
        self.in_proj = nn.Linear(input_size, hidden)  # C (and its bias)
        self.W = nn.Parameter(0.05 * torch.eye(hidden))  # slow recurrent weights, 0.05 I as in the paper
        self.ln = nn.LayerNorm(hidden, eps=eps) if layer_norm else None

    def resolve_read_mode(self, T: int, grad: bool | None = None) -> str:
        """The read form used for a call of T steps (``grad``: autograd on; default: as now)."""
        if self.read_mode != "auto":
            return self.read_mode
        grad = torch.is_grad_enabled() if grad is None else grad
        return "matrix" if T == 1 and not grad else "attention"

    def forward(self, x: Tensor, state: FastRNNState | None = None) -> tuple[Tensor, FastRNNState]:
        B, T, _ = x.shape
        u = self.in_proj(x)  # C x_t + c for every step at once, [B, T, H]
        with no_autocast(x.device):
            dtype = torch.float64 if u.dtype == torch.float64 else torch.float32  # fp32 accumulation under autocast
            u, W = u.to(dtype), self.W.to(dtype)
            ln_w = None if self.ln is None else self.ln.weight.to(dtype)
            ln_b = None if self.ln is None else self.ln.bias.to(dtype)
            h, A, hist = (None, None, None) if state is None else state
            common = dict(ln_weight=ln_w, ln_bias=ln_b, eps=self.eps)
            if not self.fast_weights:  # plain (LN-)RNN: no reads, no memory
                hs = fast_rnn_attention(u, W, h, lam=0.0, eta=0.0, inner_steps=0, ln_preliminary=True, **common)
                return hs, FastRNNState(hs[:, -1], None, None)
            fast = dict(lam=self.lam, eta=self.eta, inner_steps=self.inner_steps, ln_preliminary=self.ln_preliminary)
            if self.resolve_read_mode(T) == "matrix":
                A = fold_history(A, hist, self.lam, self.eta)
                hs, A = fast_rnn_reference(u, W, h, A, **fast, **common)
                return hs, FastRNNState(hs[:, -1], A, None)
            # attention read in pieces, folding the history into A whenever it holds `hidden` states
            window = self.hidden
            pieces, start = [], 0
            while start < T:
                stored = 0 if hist is None else hist.shape[1]
                if stored >= window:
                    A, hist, stored = fold_history(A, hist, self.lam, self.eta), None, 0
                length = min(T - start, window - stored)
                piece = fast_rnn_attention(u[:, start : start + length], W, h, A, hist, **fast, **common)
                hist = piece if hist is None else torch.cat([hist, piece], 1)
                h = piece[:, -1]
                pieces.append(piece)
                start += length
            hs = pieces[0] if len(pieces) == 1 else torch.cat(pieces, 1)
            return hs, FastRNNState(h, A, hist)


@dataclass
class FastRNNOptions:
    """Options of the ``fast_rnn`` mixer (TOML table ``[model.options.fast_rnn]``)."""

    hidden: int = 0  # hidden units H; 0 = d_model
    lam: float = 0.95  # fast-weight decay lambda
    eta: float = 0.5  # fast-weight learning rate eta
    inner_steps: int = 1  # S inner-loop reads per step
    layer_norm: bool = True  # LayerNorm before every ReLU
    ln_preliminary: bool = True  # LayerNorm on the preliminary vector h^(0)
    fast_weights: bool = True  # False = the plain LN-RNN ablation
    read_mode: str = "auto"  # auto | matrix | attention


@register_mixer("fast_rnn", FastRNNOptions)
class FastRNNMixer(nn.Module):
    """The fast-weights RNN as a sequence mixer: x [B, T, d_model] -> C -> RNN (H units) -> y [B, T, d_model].

    ``n_heads`` is accepted for the mixer interface and unused: the model has one hidden vector.
    Parameters: C (d_model x H + H), W (H x H), LN (2H), output projection (H x d_model).
    """

    def __init__(self, d_model: int, n_heads: int, options: FastRNNOptions | None = None):
        super().__init__()
        o = asdict(options or FastRNNOptions())
        self.rnn = FastWeightRNN(d_model, o.pop("hidden") or d_model, **o)  # the other options are its arguments
        self.out_proj = nn.Linear(self.rnn.hidden, d_model, bias=False)
        self.out_proj.is_residual_proj = True  # scaled init in LanguageModel, like the attention output

    def forward(self, x: Tensor, state: FastRNNState | None = None) -> tuple[Tensor, FastRNNState]:
        hs, state = self.rnn(x, state)
        return self.out_proj(hs.to(x.dtype)), state
