#pragma once
// The named tuple types of pyckpt._C: every tuple a binding takes or returns has one, defined
// here (collections.namedtuple, module "pyckpt._C") and declared in pyckpt/_C.pyi. Inputs are
// parsed as sequences of the type's layout, so a plain tuple (or a list decoded from JSON) is
// accepted wherever the named type is; outputs are instances of the named type, except chunk
// records (see Rec::Chunk).
#include <pybind11/pybind11.h>

#include <cstddef>
#include <utility>

namespace pyckpt::bindings {
namespace py = pybind11;

/** The named tuple types; the order of kRecords in records.cpp. */
enum class Rec : std::size_t {
  // Chunk and Segment name the layout of the checkpoint index's records. Those are made in bulk
  // (by the metadata readers, and as write_items results, which travel pickled to the
  // coordinator; a tuple subclass pickles many times slower than a tuple), so the bindings
  // return them as plain tuples of this layout and accept either.
  Chunk,
  Segment,
  WriteItem,
  WrittenItem,
  ReadRequest,
  ReadStats,
  MemorySource,
  MemoryRange,
  EncodedChunk,
  StitchItem,
  StitchChunk,
  FloatCast,
  HeaderTensor,
  TensorSpec,
  TensorSpan,
  EmittedHeader,
  TileBlock,
  StageItem,
  CopySpec,
  StagePiece,
  kCount,
};

/** Defines every named tuple type as an attribute of `m`; called first by PYBIND11_MODULE. */
void bind_records(py::module_& m);

/**
 * @brief An instance of the named tuple type `r` holding `values`, one per field in order (made
 *        by tuple.__new__, without the type's Python-level __new__).
 * @throws std::logic_error if the number of values is not the type's number of fields.
 */
py::object make_record(Rec r, const py::tuple& values);

/** @brief make_record(r, (args...)). */
template <typename... Args>
py::object record(Rec r, Args&&... args) {
  return make_record(r, py::make_tuple(std::forward<Args>(args)...));
}

}  // namespace pyckpt::bindings
