/* The compiled time loop of the fast-weights RNN's attention-form recurrence (fastweights.ops.fast_rnn_kernel
   loads it; the equations are in fastweights/layers/fast_rnn.py, the torch form in fastweights/ops/fast_rnn.py). Plain C99, no torch headers. */

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
/* ---- per-dtype template: REAL and _SFX are replaced for float (_f32) and double (_f64) ---- */
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
