// SPDX-License-Identifier: MIT
// Host side of the prefill GEMM (contract in gemm.h): argument checks naming the field, the weight decode into
// the context's scratch, and cuBLASLt. cuBLASLt is column-major, so the row-major problem is posed transposed:
// yᵀ[n, m] = W[n, k] · xᵀ[k, m], where W's row-major [n, k] bytes are a column-major k x n matrix (ld k) used with
// op T, xᵀ is x's row-major [m, k] seen as column-major k x m (ld ldx), and yᵀ column-major n x m (ld ldy) is
// exactly row-major y[m, n] with row stride ldy.
#include "cuda/gemm.h"

#include <cublasLt.h>

#include <algorithm>
#include <cstdint>

#include "core/check.h"
#include "cuda/cuda_check.h"

namespace dsv4 {
namespace {

#define DSV4_LT_CHECK(expr)                                                                                  \
  do {                                                                                                       \
    const cublasStatus_t dsv4_lt_status_ = (expr);                                                           \
    if (dsv4_lt_status_ != CUBLAS_STATUS_SUCCESS)                                                            \
      DSV4_FAIL("cuBLASLt error {} ({}) from {}", cublasLtGetStatusName(dsv4_lt_status_),                     \
                cublasLtGetStatusString(dsv4_lt_status_), #expr);                                            \
  } while (0)

bool aligned(const void* p, uintptr_t a) { return reinterpret_cast<uintptr_t>(p) % a == 0; }

// The largest power of two (16 .. 256) dividing the address: cuBLASLt's heuristic assumes 256-byte aligned
// buffers unless told otherwise, and an algorithm chosen for more alignment than a pointer has may fault.
int alignment_class(const void* p) {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const uintptr_t low = a & (~a + 1);
  return int(std::min<uintptr_t>(low == 0 ? 256 : low, 256));
}

void check_weight(const char* fn, const WeightDesc& w) {
  const char* fmt_name = gemv_weight_name(w.weight);
  DSV4_CHECK(w.n >= 0 && w.k > 0, "{} ({}): expected n >= 0 and k > 0, got n = {}, k = {}", fn, fmt_name, w.n, w.k);
  DSV4_CHECK(w.k % gemv_k_multiple(w.weight) == 0, "{} ({}): k = {} must be a multiple of {}", fn, fmt_name, w.k,
             gemv_k_multiple(w.weight));
  if (w.n == 0) return;
  DSV4_CHECK(w.w, "{} ({}): w must be a device pointer", fn, fmt_name);
  DSV4_CHECK(w.weight == GemvWeight::BF16 || w.w_scale, "{} ({}): w_scale is required", fn, fmt_name);
  DSV4_CHECK(aligned(w.w, 16), "{} ({}): w must be 16-byte aligned, got {}", fn, fmt_name, w.w);
  DSV4_CHECK(w.weight != GemvWeight::NVFP4 || aligned(w.w_scale, 2), "{} (nvfp4): w_scale must be 2-byte aligned",
             fn);
  DSV4_CHECK(w.weight != GemvWeight::FP8_BLOCK || w.fp8_scale != GemvScale::F32 || aligned(w.w_scale, 4),
             "{} (fp8_block): f32 w_scale must be 4-byte aligned", fn);
  DSV4_CHECK(w.layout == GemvLayout::Rows || gemv_tiles_fit(w.weight, w.n, w.k),
             "{} ({}): the tile layout needs mxfp4 / nvfp4 weights, n a multiple of 16 and k of 128 (got n = {}, k = {})",
             fn, fmt_name, w.n, w.k);
}

WeightDesc weight_of(const GemmParams& p) {
  WeightDesc w;
  w.n = p.n, w.k = p.k, w.weight = p.weight, w.w = p.w, w.w_scale = p.w_scale, w.fp8_scale = p.fp8_scale;
  w.layout = p.layout;
  return w;
}

}  // namespace

void dequantize_weight_bf16(const WeightDesc& w, uint16_t* out_bf16, cudaStream_t stream) {
  check_weight("dequantize_weight_bf16", w);
  if (w.n == 0) return;
  DSV4_CHECK(out_bf16 && aligned(out_bf16, 16), "dequantize_weight_bf16: out_bf16 must be a 16-byte aligned device "
             "pointer, got {}", static_cast<const void*>(out_bf16));
  DSV4_CUDA_CHECK(detail::dequant_weight_launch(w, out_bf16, stream));
}

size_t gemm_scratch_elements(const GemmParams& p) {
  return p.weight == GemvWeight::BF16 ? 0 : size_t(std::max(p.n, 0)) * size_t(std::max(p.k, 0));
}

struct GemmContext::Plan {
  cublasLtMatmulDesc_t desc = nullptr;
  cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
  cublasLtMatmulAlgo_t algo{};
  ~Plan() {
    if (c) cublasLtMatrixLayoutDestroy(c);
    if (b) cublasLtMatrixLayoutDestroy(b);
    if (a) cublasLtMatrixLayoutDestroy(a);
    if (desc) cublasLtMatmulDescDestroy(desc);
  }
};

GemmContext::GemmContext(size_t max_scratch_elements)
    : workspace_(kWorkspaceBytes), max_scratch_elements_(max_scratch_elements) {
  if (max_scratch_elements > 0) scratch_ = DeviceBuffer(max_scratch_elements * 2);
  cublasLtHandle_t h = nullptr;
  DSV4_LT_CHECK(cublasLtCreate(&h));
  handle_ = h;
}

GemmContext::~GemmContext() {
  plans_.clear();
  if (handle_) cublasLtDestroy(static_cast<cublasLtHandle_t>(handle_));
}

size_t GemmContext::cached_plans() const { return plans_.size(); }

const GemmContext::Plan& GemmContext::plan_for(const PlanKey& key) {
  if (auto it = plans_.find(key); it != plans_.end()) return *it->second;
  // Prefill sees one m per chunk size; bound the cache instead of growing with every distinct m. Descriptors are
  // host objects consumed when cublasLtMatmul enqueues, so dropping them is safe.
  if (plans_.size() >= 256) plans_.clear();

  auto plan = std::make_unique<Plan>();
  const cudaDataType_t out_type = key.out == int(GemvOut::F32) ? CUDA_R_32F : CUDA_R_16BF;
  DSV4_LT_CHECK(cublasLtMatmulDescCreate(&plan->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  const cublasOperation_t op_t = CUBLAS_OP_T, op_n = CUBLAS_OP_N;
  DSV4_LT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_t, sizeof(op_t)));
  DSV4_LT_CHECK(cublasLtMatmulDescSetAttribute(plan->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_n, sizeof(op_n)));
  DSV4_LT_CHECK(cublasLtMatrixLayoutCreate(&plan->a, CUDA_R_16BF, uint64_t(key.k), uint64_t(key.n), key.k));
  DSV4_LT_CHECK(cublasLtMatrixLayoutCreate(&plan->b, CUDA_R_16BF, uint64_t(key.k), uint64_t(key.m), key.ldx));
  DSV4_LT_CHECK(cublasLtMatrixLayoutCreate(&plan->c, out_type, uint64_t(key.n), uint64_t(key.m), key.ldy));

  cublasLtMatmulPreference_t pref = nullptr;
  DSV4_LT_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  const uint64_t ws = kWorkspaceBytes;
  const uint32_t al_a = uint32_t(key.align_w), al_b = uint32_t(key.align_x), al_cd = uint32_t(key.align_y);
  cublasStatus_t st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &ws,
                                                           sizeof(ws));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &al_a, sizeof(al_a));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &al_b, sizeof(al_b));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &al_cd, sizeof(al_cd));
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &al_cd, sizeof(al_cd));
  // Split-k partial sums must stay fp32: a reduction in the output type (bf16) rounds every partial (measured on
  // the H200: results 1 bf16 ulp off at m = 300, n = 4097, k = 1024 with bf16 out).
  const uint32_t reductions = CUBLASLT_REDUCTION_SCHEME_NONE | CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK, &reductions,
                                              sizeof(reductions));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS)
    st = cublasLtMatmulAlgoGetHeuristic(static_cast<cublasLtHandle_t>(handle_), plan->desc, plan->a, plan->b,
                                        plan->c, plan->c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  DSV4_LT_CHECK(st);
  DSV4_CHECK(found > 0 && result.state == CUBLAS_STATUS_SUCCESS,
             "gemm: cuBLASLt has no bf16 algorithm for m = {}, n = {}, k = {}, ldx = {}, ldy = {} ({} out)", key.m,
             key.n, key.k, key.ldx, key.ldy, key.out == int(GemvOut::F32) ? "f32" : "bf16");
  plan->algo = result.algo;
  return *plans_.emplace(key, std::move(plan)).first->second;
}

void GemmContext::gemm(const GemmParams& p) {
  const char* fmt_name = gemv_weight_name(p.weight);
  DSV4_CHECK(p.m >= 0, "gemm ({}): m = {} must be >= 0", fmt_name, p.m);
  check_weight("gemm", weight_of(p));
  if (p.m == 0 || p.n == 0) return;
  const int64_t ldx = p.ldx ? p.ldx : p.k, ldy = p.ldy ? p.ldy : p.n;
  const int64_t out_bytes = p.out == GemvOut::F32 ? 4 : 2;
  DSV4_CHECK(p.x && p.y, "gemm ({}): x and y must be device pointers, got x={} y={}", fmt_name, p.x, p.y);
  DSV4_CHECK(aligned(p.x, 16) && aligned(p.y, 16), "gemm ({}): x and y must be 16-byte aligned, got x={} y={}",
             fmt_name, p.x, p.y);
  DSV4_CHECK(ldx >= p.k && ldx % 8 == 0, "gemm ({}): ldx = {} must be >= k = {} and a multiple of 8", fmt_name, ldx,
             p.k);
  DSV4_CHECK(ldy >= p.n && (ldy * out_bytes) % 16 == 0,
             "gemm ({}): ldy = {} must be >= n = {} and a multiple of {} ({} output)", fmt_name, ldy, p.n,
             16 / out_bytes, p.out == GemvOut::F32 ? "f32" : "bf16");
  DSV4_CHECK(!p.accumulate || p.out == GemvOut::F32, "gemm ({}): accumulate needs f32 output", fmt_name);
  const size_t scratch_needed = gemm_scratch_elements(p);
  DSV4_CHECK(scratch_needed <= max_scratch_elements_,
             "gemm ({}): the weight [{}, {}] needs {} bf16 scratch elements, the GemmContext was built with {}",
             fmt_name, p.n, p.k, scratch_needed, max_scratch_elements_);

  const void* w_bf16 = p.w;
  if (p.weight != GemvWeight::BF16) {
    DSV4_CUDA_CHECK(detail::dequant_weight_launch(weight_of(p), scratch_.as<uint16_t>(), p.stream));
    w_bf16 = scratch_.data();
  }
  const PlanKey key{p.m, p.n, p.k, ldx, ldy, int(p.out), p.accumulate,
                    alignment_class(p.x), alignment_class(w_bf16), alignment_class(p.y)};
  const Plan& plan = plan_for(key);
  // NVFP4's per-tensor scale multiplies the fp32 sums (the scratch holds e2m1 * e4m3 only, exact in bf16).
  const float alpha = p.weight == GemvWeight::NVFP4 ? p.w_scale_2 : 1.0f;
  const float beta = p.accumulate ? 1.0f : 0.0f;
  DSV4_LT_CHECK(cublasLtMatmul(static_cast<cublasLtHandle_t>(handle_), plan.desc, &alpha, w_bf16, plan.a, p.x,
                               plan.b, &beta, p.y, plan.c, p.y, plan.c, &plan.algo, workspace_.data(),
                               kWorkspaceBytes, p.stream));
}

}  // namespace dsv4
