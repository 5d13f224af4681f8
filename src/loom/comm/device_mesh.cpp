#include "loom/comm/device_mesh.h"

#include "loom/core/error.h"

namespace loom {

DeviceMesh::DeviceMesh(int world, std::vector<MeshDim> dims) : world_(world), dims_(std::move(dims)) {
  LOOM_CHECK(world_ >= 1 && !dims_.empty(), "device mesh: a world of ", world_, " ranks needs at least one dimension");
  int product = 1, open = -1;
  for (size_t d = 0; d < dims_.size(); ++d) {
    LOOM_CHECK(dims_[d].size >= 0, "device mesh: parallel.", dims_[d].name, " = ", dims_[d].size, " must be >= 0");
    for (size_t e = 0; e < d; ++e) LOOM_CHECK(dims_[e].name != dims_[d].name, "device mesh: dimension ", dims_[d].name, " twice");
    if (dims_[d].size == 0) {
      LOOM_CHECK(open < 0, "device mesh: only one of parallel.", dims_[open].name, " and parallel.", dims_[d].name,
                 " may be 0 (the ranks left)");
      open = static_cast<int>(d);
    } else {
      product *= dims_[d].size;
    }
  }
  if (open >= 0) {
    LOOM_CHECK(world_ % product == 0, "device mesh: ", world_, " ranks are not a multiple of ", describe(),
               " (the other dimensions' product ", product, ")");
    dims_[open].size = world_ / product;
    product = world_;
  }
  LOOM_CHECK(product == world_, "device mesh: ", describe(), " needs ", product, " ranks, the job has ", world_);
}

int DeviceMesh::index(const std::string& dim) const {
  for (size_t d = 0; d < dims_.size(); ++d) {
    if (dims_[d].name == dim) return static_cast<int>(d);
  }
  throw Error(str_cat("device mesh ", describe(), " has no dimension '", dim, "'"));
}

int DeviceMesh::stride(int d) const {
  int s = 1;
  for (size_t e = static_cast<size_t>(d) + 1; e < dims_.size(); ++e) s *= dims_[e].size;
  return s;
}

int DeviceMesh::size(const std::string& dim) const { return dims_[index(dim)].size; }

int DeviceMesh::coord(int rank, const std::string& dim) const {
  LOOM_CHECK(rank >= 0 && rank < world_, "device mesh: rank ", rank, " outside [0, ", world_, ")");
  const int d = index(dim);
  return rank / stride(d) % dims_[d].size;
}

std::vector<int> DeviceMesh::group(int rank, const std::string& dim) const {
  const int d = index(dim);
  const int base = rank - coord(rank, dim) * stride(d);
  std::vector<int> ranks;
  for (int i = 0; i < dims_[d].size; ++i) ranks.push_back(base + i * stride(d));
  return ranks;
}

std::string DeviceMesh::describe() const {
  std::string out;
  for (const MeshDim& d : dims_) out += (out.empty() ? "" : " x ") + d.name + "=" + (d.size ? std::to_string(d.size) : "?");
  return out;
}

std::unique_ptr<Communicator> mesh_group(Communicator& world, const DeviceMesh& mesh, const std::string& dim) {
  return mesh_group(world, mesh, std::vector<std::string>{dim});
}

std::unique_ptr<Communicator> mesh_group(Communicator& world, const DeviceMesh& mesh, const std::vector<std::string>& dims) {
  LOOM_CHECK(world.size() == mesh.world(), "mesh group: the mesh ", mesh.describe(), " has ", mesh.world(),
             " ranks, the communicator ", world.size());
  const int r = world.rank();
  int color = r, key = 0;
  for (const std::string& dim : dims) {  // the group's first rank is the color; the key orders by coordinates
    color = mesh.group(color, dim).front();
    key = key * mesh.size(dim) + mesh.coord(r, dim);
  }
  return world.split(color, key);
}

DeviceMesh training_mesh(int world, int dp, int tp, int pp, int cp, int ep) {
  if (ep <= 1) return DeviceMesh(world, {{"pp", pp}, {"dp", dp}, {"cp", cp}, {"tp", tp}});
  LOOM_CHECK(dp == 0 || dp % ep == 0, "parallel.ep = ", ep, " must divide parallel.dp = ", dp);
  return DeviceMesh(world, {{"pp", pp}, {"dp", dp == 0 ? 0 : dp / ep}, {"ep", ep}, {"cp", cp}, {"tp", tp}});
}

std::vector<std::string> data_parallel_dims(const DeviceMesh& mesh) {
  for (const MeshDim& d : mesh.dims()) {
    if (d.name == "ep") return {"dp", "ep"};
  }
  return {"dp"};
}

}  // namespace loom
