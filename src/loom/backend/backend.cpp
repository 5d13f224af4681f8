// The defaults of the Backend interface's optional ops: a one-line error naming the op and the
// backend (the gradient compression ops; a backend that has them says so in its capabilities).
#include "loom/backend/backend.h"

#include "loom/core/error.h"

namespace loom {

namespace {
[[noreturn]] void unsupported(const Backend& backend, const char* op) {
  throw Error(str_cat(op, ": not implemented on the ", backend.name(),
                      " backend (gradient compression runs on the CPU backend only)"));
}
}  // namespace

void Backend::topk_extract(const Tensor&, const Tensor&, const Tensor&, const Tensor&) { unsupported(*this, "topk_extract"); }
void Backend::scatter_add(const Tensor&, const Tensor&, const Tensor&) { unsupported(*this, "scatter_add"); }
void Backend::scatter_zero(const Tensor&, const Tensor&) { unsupported(*this, "scatter_zero"); }
void Backend::dgc_accumulate(const Tensor&, const Tensor&, const Tensor&, float, double) {
  unsupported(*this, "dgc_accumulate");
}
void Backend::onebit_encode(const Tensor&, const Tensor&, const Tensor&) { unsupported(*this, "onebit_encode"); }
void Backend::onebit_decode_add(const Tensor&, const Tensor&, const Tensor&) { unsupported(*this, "onebit_decode_add"); }
void Backend::qsgd_encode(const Tensor&, const Tensor&, const Tensor&, const QsgdSpec&) { unsupported(*this, "qsgd_encode"); }
void Backend::qsgd_decode_add(const Tensor&, const Tensor&, int, const Tensor&) { unsupported(*this, "qsgd_decode_add"); }
void Backend::lowrank_project(const Tensor&, const Tensor&, const Tensor&, bool) { unsupported(*this, "lowrank_project"); }
void Backend::orthonormalize_columns(const Tensor&) { unsupported(*this, "orthonormalize_columns"); }
void Backend::lowrank_expand(const Tensor&, const Tensor&, const Tensor&, float, float) {
  unsupported(*this, "lowrank_expand");
}

}  // namespace loom
