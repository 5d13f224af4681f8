// The ranks of a job as a named grid (PyTorch's DeviceMesh, Megatron's rank order): dimensions
// listed outermost first, the last one varying fastest, so rank = sum_d coord_d x stride_d.
// Loom's order is pp x dp x cp x tp: tensor-parallel groups are consecutive ranks (one node's
// fast links), pipeline stages the farthest apart. A group along a dimension is the ranks
// sharing every other coordinate; collectives of that dimension run inside it.
#pragma once
#include <memory>
#include <string>
#include <vector>

#include "loom/comm/communicator.h"

namespace loom {

struct MeshDim {
  std::string name;
  int size = 1;
};

class DeviceMesh {
 public:
  // The sizes must multiply to `world`; at most one size may be 0, meaning "the ranks left".
  DeviceMesh(int world, std::vector<MeshDim> dims);

  int world() const { return world_; }
  const std::vector<MeshDim>& dims() const { return dims_; }
  int size(const std::string& dim) const;               // throws naming an unknown dimension
  int coord(int rank, const std::string& dim) const;    // rank's index along dim
  std::vector<int> group(int rank, const std::string& dim) const;  // ranks of rank's group along dim, by coord
  std::string describe() const;                         // "pp=1 x dp=4 x cp=1 x tp=1"

 private:
  int index(const std::string& dim) const;
  int stride(int d) const;

  int world_;
  std::vector<MeshDim> dims_;
};

// This rank's communicator along `dim` of the mesh (its group, ranked by coordinate); every
// rank of `world` must call it for the same dim.
std::unique_ptr<Communicator> mesh_group(Communicator& world, const DeviceMesh& mesh, const std::string& dim);
// The ranks sharing every coordinate but those of `dims` (e.g. {"dp", "cp"}: the group whose
// gradients are averaged when context parallel ranks act as data parallel ones).
std::unique_ptr<Communicator> mesh_group(Communicator& world, const DeviceMesh& mesh, const std::vector<std::string>& dims);

// The training mesh pp x dp x cp x tp from the parallel.* sizes (dp = 0: the ranks left). With
// expert parallelism (ep > 1) the data-parallel ranks are split as dp/ep x ep: pp x dp x ep x cp
// x tp, "dp" then naming the outer part; the data-parallel group is {"dp", "ep"}.
DeviceMesh training_mesh(int world, int dp, int tp, int pp, int cp, int ep = 1);
// The data-parallel group of a training mesh (dp, or dp x ep).
std::vector<std::string> data_parallel_dims(const DeviceMesh& mesh);

}  // namespace loom
