#include "common/safetensors.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>
#include <set>

#include "common/json_limits.h"

namespace dflash {
namespace {

struct DTypeInfo {
  DType dtype;
  const char* name;
  size_t size;
};
constexpr DTypeInfo kDTypes[] = {
    {DType::F64, "F64", 8},   {DType::F32, "F32", 4},         {DType::F16, "F16", 2},
    {DType::BF16, "BF16", 2}, {DType::I64, "I64", 8},         {DType::I32, "I32", 4},
    {DType::I16, "I16", 2},   {DType::I8, "I8", 1},           {DType::U8, "U8", 1},
    {DType::BOOL, "BOOL", 1}, {DType::F8_E4M3, "F8_E4M3", 1}, {DType::F8_E5M2, "F8_E5M2", 1},
};

[[noreturn]] void fail(const std::string& path, const std::string& what) {
  throw SafetensorsError(path + ": " + what);
}

std::string system_error(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

}  // namespace

const char* dtype_name(DType dtype) {
  for (const auto& d : kDTypes)
    if (d.dtype == dtype) return d.name;
  return "?";
}
size_t dtype_size(DType dtype) {
  for (const auto& d : kDTypes)
    if (d.dtype == dtype) return d.size;
  return 0;
}
bool parse_dtype(const std::string& name, DType* out) {
  for (const auto& d : kDTypes) {
    if (name == d.name) {
      *out = d.dtype;
      return true;
    }
  }
  return false;
}

int64_t TensorEntry::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

// The whole file mapped read-only; `*bytes` is its size.
void* map_file(const std::string& path, size_t* bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail(path, system_error("cannot open"));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    ::close(fd);
    fail(path, system_error("cannot stat"));
  }
  *bytes = static_cast<size_t>(st.st_size);
  if (*bytes < 8) {
    ::close(fd);
    fail(path, "truncated: " + std::to_string(*bytes) + " bytes, shorter than the 8-byte header length");
  }
  void* mapping = ::mmap(nullptr, *bytes, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (mapping == MAP_FAILED) fail(path, system_error("cannot mmap"));
  return mapping;
}

// The little-endian header length, checked against the limit and the file size.
uint64_t header_length(const std::string& path, const std::byte* bytes, size_t file_bytes) {
  uint64_t header_bytes = 0;
  for (int i = 7; i >= 0; --i) header_bytes = (header_bytes << 8) | static_cast<uint8_t>(bytes[i]);
  if (header_bytes > SafetensorsFile::kMaxHeaderBytes) {
    fail(path, "corrupt header: header length " + std::to_string(header_bytes) + " exceeds the 100 MB limit");
  }
  if (8 + header_bytes > file_bytes) {
    fail(path, "truncated: the header claims " + std::to_string(header_bytes) + " bytes but the file has " +
                   std::to_string(file_bytes - 8) + " after the length");
  }
  return header_bytes;
}

// The header's JSON object. Duplicate names are rejected: nlohmann keeps the last silently, so
// the keys of the top-level object are watched as the parser reports them.
nlohmann::json parse_header(const std::string& path, const char* header, uint64_t header_bytes) {
  if (header_bytes == 0 || header[0] != '{') fail(path, "corrupt header: it is not a JSON object");
  if (const std::string problem = json_text_problem({header, header_bytes}); !problem.empty()) {
    fail(path, "corrupt header: " + problem);
  }
  std::set<std::string> seen;
  std::string duplicate;
  nlohmann::json json;
  try {
    json = nlohmann::json::parse(header, header + header_bytes,
                                 [&](int depth, nlohmann::json::parse_event_t event, nlohmann::json& parsed) {
                                   if (depth == 1 && event == nlohmann::json::parse_event_t::key) {
                                     const std::string key = parsed.get<std::string>();
                                     if (!seen.insert(key).second && duplicate.empty()) duplicate = key;
                                   }
                                   return true;
                                 });
  } catch (const nlohmann::json::exception& e) {
    fail(path, std::string("corrupt header: invalid JSON: ") + e.what());
  }
  if (!duplicate.empty()) fail(path, "corrupt header: tensor '" + duplicate + "' appears twice");
  if (!json.is_object()) fail(path, "corrupt header: it is not a JSON object");
  return json;
}

// One tensor's header entry, its size checked against its dtype and shape (with overflow checks)
// and its offsets against the data buffer.
TensorEntry parse_entry(const std::string& path, const std::string& name, const nlohmann::json& value,
                        const std::byte* buffer, size_t buffer_bytes) {
  const std::string where = "tensor '" + name + "': ";
  if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") || !value.contains("data_offsets")) {
    fail(path, "corrupt header: " + where + "needs dtype, shape and data_offsets");
  }
  TensorEntry entry;
  entry.name = name;
  if (!value["dtype"].is_string() || !parse_dtype(value["dtype"].get<std::string>(), &entry.dtype)) {
    fail(path, where + "unsupported dtype " + value["dtype"].dump());
  }
  const auto& shape = value["shape"];
  if (!shape.is_array()) fail(path, "corrupt header: " + where + "shape is not a list");
  for (const auto& d : shape) {
    if (!d.is_number_unsigned()) fail(path, "corrupt header: " + where + "shape " + shape.dump() + " is not a list of sizes");
    entry.shape.push_back(d.get<int64_t>());
  }
  const auto& offsets = value["data_offsets"];
  if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() ||
      !offsets[1].is_number_unsigned()) {
    fail(path, "corrupt header: " + where + "data_offsets must be [begin, end]");
  }
  const uint64_t begin = offsets[0].get<uint64_t>(), end = offsets[1].get<uint64_t>();
  if (begin > end || end > buffer_bytes) {
    fail(path, where + "data_offsets [" + std::to_string(begin) + ", " + std::to_string(end) +
                   "] out of bounds of the " + std::to_string(buffer_bytes) + "-byte data buffer (truncated file?)");
  }
  // product(shape) * size; a product past 2^64 bytes cannot match any data_offsets (and a
  // wrapped product could: [2^32]^4 of 2-byte elements wraps to 0 in 128 bits).
  uint64_t expected = dtype_size(entry.dtype);
  bool overflow = false;
  for (int64_t d : entry.shape) overflow = overflow || __builtin_mul_overflow(expected, static_cast<uint64_t>(d), &expected);
  if (overflow) {
    fail(path, where + "shape " + shape.dump() + " of " + dtype_name(entry.dtype) + " needs more than 2^64 bytes");
  }
  if (expected != end - begin) {
    fail(path, where + "shape " + shape.dump() + " of " + dtype_name(entry.dtype) + " needs " +
                   std::to_string(expected) + " bytes but data_offsets give " + std::to_string(end - begin));
  }
  entry.data = buffer + begin;
  entry.bytes = static_cast<size_t>(end - begin);
  return entry;
}

// The tensors are contiguous and non-overlapping and cover the whole buffer (the reference's rule).
void check_layout(const std::string& path, const std::vector<TensorEntry>& tensors, const std::byte* buffer,
                  size_t buffer_bytes) {
  std::vector<const TensorEntry*> by_offset;
  for (const auto& t : tensors) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](const TensorEntry* a, const TensorEntry* b) {
    return a->data < b->data || (a->data == b->data && a->bytes < b->bytes);
  });
  size_t cursor = 0;
  for (const TensorEntry* t : by_offset) {
    const size_t begin = static_cast<size_t>(t->data - buffer);
    if (begin != cursor) {
      fail(path, "corrupt header: tensor '" + t->name + "' starts at byte " + std::to_string(begin) +
                     (begin < cursor ? " inside the previous tensor (overlap)" : " leaving a gap") + ", expected " +
                     std::to_string(cursor));
    }
    cursor = begin + t->bytes;
  }
  if (cursor != buffer_bytes) {
    fail(path, "file size is not exact: the tensors end at byte " + std::to_string(cursor) + " of a " +
                   std::to_string(buffer_bytes) + "-byte data buffer");
  }
}

}  // namespace

std::shared_ptr<SafetensorsFile> SafetensorsFile::open(const std::string& path) {
  std::shared_ptr<SafetensorsFile> file(new SafetensorsFile());
  file->path_ = path;
  size_t file_bytes = 0;
  file->mapping_ = map_file(path, &file_bytes);  // unmapped by the destructor if parsing throws
  file->mapping_bytes_ = file_bytes;
  const auto* bytes = static_cast<const std::byte*>(file->mapping_);
  const uint64_t header_bytes = header_length(path, bytes, file_bytes);
  const nlohmann::json json = parse_header(path, reinterpret_cast<const char*>(bytes + 8), header_bytes);
  const size_t buffer_bytes = file_bytes - 8 - header_bytes;
  const std::byte* buffer = bytes + 8 + header_bytes;
  for (auto it = json.begin(); it != json.end(); ++it) {
    if (it.key() == "__metadata__") {
      if (!it.value().is_object()) fail(path, "corrupt header: __metadata__ is not an object");
      for (auto m = it.value().begin(); m != it.value().end(); ++m) {
        if (!m.value().is_string()) fail(path, "corrupt header: __metadata__." + m.key() + " is not a string");
        file->metadata_[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    file->tensors_.push_back(parse_entry(path, it.key(), it.value(), buffer, buffer_bytes));
  }
  check_layout(path, file->tensors_, buffer, buffer_bytes);
  for (size_t i = 0; i < file->tensors_.size(); ++i) file->index_[file->tensors_[i].name] = i;
  return file;
}

SafetensorsFile::~SafetensorsFile() {
  if (mapping_) ::munmap(mapping_, mapping_bytes_);
}

const TensorEntry* SafetensorsFile::find(const std::string& name) const {
  auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

const TensorEntry& SafetensorsFile::get(const std::string& name) const {
  const TensorEntry* entry = find(name);
  if (!entry) throw SafetensorsError(path_ + ": missing tensor '" + name + "'");
  return *entry;
}

namespace {

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw SafetensorsError(path + ": " + system_error("write failed"));
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

// Runs `fill(fd)` into PATH.tmp-PID, then fsync + rename + directory fsync.
template <class Fill>
void write_atomically(const std::string& path, Fill fill) {
  const std::string temporary = path + ".tmp-" + std::to_string(::getpid());
  const int fd = ::open(temporary.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw SafetensorsError(temporary + ": " + system_error("cannot create"));
  try {
    fill(fd, temporary);
    if (::fsync(fd) != 0) throw SafetensorsError(temporary + ": " + system_error("fsync failed"));
  } catch (...) {
    ::close(fd);
    ::unlink(temporary.c_str());
    throw;
  }
  ::close(fd);
  if (::rename(temporary.c_str(), path.c_str()) != 0) {
    ::unlink(temporary.c_str());
    throw SafetensorsError(path + ": " + system_error("rename failed"));
  }
  const size_t slash = path.find_last_of('/');
  const std::string dir = slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const int dir_fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    ::fsync(dir_fd);  // make the rename itself durable
    ::close(dir_fd);
  }
}

}  // namespace

void write_safetensors(const std::string& path, const std::vector<TensorToWrite>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  std::set<std::string> names;
  for (const auto& t : tensors) {
    if (!names.insert(t.name).second) throw SafetensorsError(path + ": tensor '" + t.name + "' given twice");
    size_t expected = dtype_size(t.dtype);
    for (int64_t d : t.shape) expected *= static_cast<size_t>(d);
    if (expected != t.bytes) {
      throw SafetensorsError(path + ": tensor '" + t.name + "': " + std::to_string(t.bytes) +
                             " bytes given for a shape that needs " + std::to_string(expected));
    }
    header[t.name] = {{"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.bytes}}};
    offset += t.bytes;
  }
  std::string text = header.dump();
  text.append((8 - text.size() % 8) % 8, ' ');  // align the data buffer to 8 bytes, as the reference does
  write_atomically(path, [&](int fd, const std::string& temporary) {
    uint8_t length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<uint8_t>(static_cast<uint64_t>(text.size()) >> (8 * i));
    write_all(fd, length, 8, temporary);
    write_all(fd, text.data(), text.size(), temporary);
    for (const auto& t : tensors) write_all(fd, t.data, t.bytes, temporary);
  });
}

void make_directories(const std::string& path) {
  for (size_t i = 1; i <= path.size(); ++i) {
    if (i != path.size() && path[i] != '/') continue;
    const std::string prefix = path.substr(0, i);
    if (::mkdir(prefix.c_str(), 0755) != 0 && errno != EEXIST) {
      throw std::runtime_error(prefix + ": cannot create directory: " + std::strerror(errno));
    }
  }
}

void write_file_atomically(const std::string& path, const std::string& content) {
  write_atomically(path, [&](int fd, const std::string& temporary) { write_all(fd, content.data(), content.size(), temporary); });
}

}  // namespace dflash
