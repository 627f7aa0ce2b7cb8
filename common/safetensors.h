// safetensors.h: reading and writing the safetensors format, without torch.
//
// Format (https://github.com/huggingface/safetensors): 8 bytes little-endian u64 N, then N
// bytes of JSON header {"NAME": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]},
// ..., "__metadata__": {"k": "v"}}, then the data buffer; offsets are relative to the buffer.
// Validation follows the reference implementation: header at most 100 MB and a JSON object,
// no duplicate names, known dtypes, offsets in bounds, tensors contiguous and non-overlapping
// and covering the buffer exactly, bytes = product(shape) * dtype size, file size exact.
//
// SafetensorsFile memory-maps the file read-only; TensorEntry::data points into the mapping
// and stays valid while the SafetensorsFile (shared_ptr) lives. Errors throw SafetensorsError
// naming the file (and the tensor where one is at fault). Immutable after open: any thread may
// read concurrently.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace dflash {

enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, BOOL, F8_E4M3, F8_E5M2 };

const char* dtype_name(DType dtype);  // "BF16"
size_t dtype_size(DType dtype);
bool parse_dtype(const std::string& name, DType* out);

class SafetensorsError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct TensorEntry {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const std::byte* data = nullptr;  // into the mapping
  size_t bytes = 0;
  int64_t numel() const;
};

class SafetensorsFile {
 public:
  static constexpr uint64_t kMaxHeaderBytes = 100'000'000;
  static std::shared_ptr<SafetensorsFile> open(const std::string& path);
  ~SafetensorsFile();

  const std::string& path() const { return path_; }
  const std::vector<TensorEntry>& tensors() const { return tensors_; }
  const TensorEntry* find(const std::string& name) const;  // nullptr if absent
  const TensorEntry& get(const std::string& name) const;   // throws naming the file and tensor
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  SafetensorsFile() = default;
  std::string path_;
  void* mapping_ = nullptr;
  size_t mapping_bytes_ = 0;
  std::vector<TensorEntry> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write: the bytes are copied from `data` (little-endian, row-major).
struct TensorToWrite {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data;
  size_t bytes;
};

// Writes atomically: a temporary file beside `path`, fsync, rename, fsync of the directory.
// Tensors are laid out in the given order. Throws SafetensorsError on I/O errors or on a
// tensor whose byte count does not match its shape and dtype.
void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Writes `content` to `path` atomically (same protocol); throws std::runtime_error naming the path.
void write_file_atomically(const std::string& path, const std::string& content);

// mkdir -p; throws std::runtime_error naming the directory it could not create.
void make_directories(const std::string& path);

}  // namespace dflash
