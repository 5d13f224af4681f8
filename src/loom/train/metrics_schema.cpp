#include "loom/train/metrics_schema.h"

#include <cmath>
#include <concepts>
#include <limits>
#include <type_traits>
#include <utility>

#include "loom/core/error.h"

namespace loom {

namespace {

using nlohmann::json;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A value quoted in an error. The replacing handler: a record built in code may hold bytes that
// are not UTF-8 (a parsed one cannot: the parser refuses them), and the message must not throw.
std::string quoted(const json& value) {
  return record_excerpt(value.dump(-1, ' ', false, json::error_handler_t::replace), 30);
}

std::string key_name(std::string_view key) { return str_cat('"', record_excerpt(key, 30), '"'); }

// What a key kept as JSON must be: anything, an object, an array, or memory_json's shape.
enum class Shape : uint8_t { any, object, array, memory };

// The keys of one JSON object, read with their types checked. `path` names the object in
// messages: "" for the record, "\"resident_bytes\"." for a nested one.
class Fields {
 public:
  Fields(const json& object, const std::string& where, std::string path = "")
      : object_(object), where_(where), path_(std::move(path)) {}

  const std::string& where() const { return where_; }

  // nullptr when absent or null (which every reader but number() takes as absent).
  const json* find(std::string_view key) const {
    const auto it = object_.find(key);
    return it == object_.end() || it->is_null() ? nullptr : &*it;
  }
  [[noreturn]] void wrong(std::string_view key, const json& value, const char* expected) const {
    throw Error(str_cat(where_, ": ", path_, key_name(key), " is ", quoted(value), ", expected ", expected));
  }
  [[noreturn]] void missing(std::string_view key, const char* expected) const {
    throw Error(str_cat(where_, ": ", path_, key_name(key), " is missing, expected ", expected));
  }

  // Null is NaN: nlohmann/json writes NaN and infinities as null.
  std::optional<double> number(std::string_view key) const {
    const auto it = object_.find(key);
    if (it == object_.end()) return std::nullopt;
    if (it->is_null()) return kNaN;
    if (!it->is_number()) wrong(key, *it, "a number");
    return it->get<double>();
  }
  double required_number(std::string_view key) const {
    const std::optional<double> v = number(key);
    if (!v) missing(key, "a number");
    return *v;
  }
  // A JSON integer, or a number with a whole value (1e+08: a tool that rewrote the file through
  // doubles), >= 0 and within int64_t: every integer of the schema counts something.
  std::optional<int64_t> integer(std::string_view key) const {
    const std::optional<uint64_t> v = unsigned_integer(key);
    if (v && *v > uint64_t{std::numeric_limits<int64_t>::max()}) wrong(key, *find(key), "a whole number >= 0");
    return v ? std::optional<int64_t>(static_cast<int64_t>(*v)) : std::nullopt;
  }
  // The same within uint64_t: a byte count.
  std::optional<uint64_t> unsigned_integer(std::string_view key) const {
    const json* v = find(key);
    if (v == nullptr) return std::nullopt;
    if (v->is_number_unsigned()) return v->get<uint64_t>();  // what the parser makes of a count
    if (v->is_number_integer() && v->get<int64_t>() >= 0) return static_cast<uint64_t>(v->get<int64_t>());
    constexpr double kTwo64 = 18446744073709551616.0;
    const double d = v->is_number_float() ? v->get<double>() : -1.0;  // (anything else: refused below)
    if (!(d >= 0 && d < kTwo64 && d == std::floor(d))) wrong(key, *v, "a whole number >= 0");
    return static_cast<uint64_t>(d);
  }
  std::optional<std::string> text(std::string_view key) const {
    const json* v = find(key);
    if (v == nullptr) return std::nullopt;
    if (!v->is_string()) wrong(key, *v, "a string");
    return v->get<std::string>();
  }
  std::string required_text(std::string_view key) const {
    std::optional<std::string> v = text(key);
    if (!v) {
      if (object_.contains(key)) wrong(key, nullptr, "a string");
      missing(key, "a string");
    }
    return std::move(*v);
  }
  std::optional<bool> boolean(std::string_view key) const {
    const json* v = find(key);
    if (v != nullptr && !v->is_boolean()) wrong(key, *v, "true or false");
    return v == nullptr ? std::nullopt : std::optional<bool>(v->get<bool>());
  }
  std::optional<json> object(std::string_view key) const { return value(key, Shape::object); }
  std::optional<json> value(std::string_view key, Shape shape) const {
    const json* v = find(key);
    if (v != nullptr && shape == Shape::object && !v->is_object()) wrong(key, *v, "an object");
    if (v != nullptr && shape == Shape::array && !v->is_array()) wrong(key, *v, "an array");
    return v == nullptr ? std::nullopt : std::optional<json>(*v);
  }

 private:
  const json& object_;
  const std::string& where_;
  std::string path_;
};

// memory_json's shape (apps/loom/train_output.cpp): an object per category whose byte counts
// are whole numbers >= 0 (or null).
void check_memory(const json& memory, const std::string& where) {
  for (const auto& [category, bytes] : memory.items()) {
    if (!bytes.is_object()) {
      throw Error(str_cat(where, ": \"memory\".", key_name(category), " is ", quoted(bytes),
                          ", expected {\"current\", \"peak\"}"));
    }
    const Fields counts(bytes, where, str_cat("\"memory\".", key_name(category), "."));
    counts.unsigned_integer("current");
    counts.unsigned_integer("peak");
  }
}

// One list of keys per record kind, which both to_json (Writer) and the parsers (Reader) visit:
// visit(key, member) for each, with a Shape for members kept as JSON. `R` is the record, const
// for writing.
template <class R, class Visit>
  requires std::same_as<std::remove_const_t<R>, StartRecord>
void visit_fields(R& r, Visit&& visit) {
  visit("schema_version", r.schema_version);
  visit("event", r.event);
  visit("start_step", r.start_step);
  visit("optimizer", r.optimizer);
  visit("parameters", r.parameters);
  visit("optimizer_state_bytes", r.optimizer_state_bytes);
  visit("state_bytes_per_param", r.state_bytes_per_param);
  visit("schedule", r.schedule);
  visit("precision", r.precision);
  visit("loss_scaling", r.loss_scaling);
  visit("mfu_peak_dtype", r.mfu_peak_dtype);
  visit("mfu_peak_gflops", r.mfu_peak_gflops);
  visit("datasheet_peak_gflops", r.datasheet_peak_gflops);
}

template <class R, class Visit>
  requires std::same_as<std::remove_const_t<R>, StepRecord>
void visit_fields(R& r, Visit&& visit) {
  visit("step", r.step);
  visit("loss", r.loss);
  visit("lr", r.lr);
  visit("grad_norm", r.grad_norm);
  visit("tokens", r.tokens);
  visit("seconds", r.seconds);
  visit("loss_scale", r.loss_scale);
  visit("skipped", r.skipped);
  visit("tokens_per_s", r.tokens_per_s);
  visit("mfu", r.mfu);
  visit("memory_bytes", r.memory_bytes);
  visit("ranks", r.ranks);
  visit("comm_bytes_sent", r.comm_bytes_sent);
  visit("comm_bytes_received", r.comm_bytes_received);
  visit("comm", r.comm, Shape::object);
  visit("resident_bytes", r.resident_bytes);
  visit("moe", r.moe, Shape::array);
}

template <class R, class Visit>
  requires std::same_as<std::remove_const_t<R>, ValidationRecord>
void visit_fields(R& r, Visit&& visit) {
  visit("step", r.step);
  visit("val_loss", r.val_loss);
  visit("val_reward", r.val_reward);
  visit("memory", r.memory, Shape::memory);
}

template <class R, class Visit>
  requires std::same_as<std::remove_const_t<R>, AnomalyRecord>
void visit_fields(R& r, Visit&& visit) {
  visit("step", r.step);
  visit("anomaly", r.anomaly);
  visit("loss", r.loss);
  visit("spike_z", r.spike_z);
  visit("batch", r.batch, Shape::any);
  visit("action", r.action);
  visit("next_step", r.next_step);
}

// A required member is always written, an optional one when it holds a value.
struct Writer {
  json& out;
  template <class T>
  void operator()(const char* key, const T& value, Shape = Shape::any) const {
    out[key] = value;
  }
  template <class T>
  void operator()(const char* key, const std::optional<T>& value, Shape shape = Shape::any) const {
    if (value) (*this)(key, *value, shape);
  }
  void operator()(const char* key, const ResidentBytes& r, Shape = Shape::any) const {
    out[key] = {{"parameters", r.parameters}, {"gradients", r.gradients}};
  }
};

// A required member's key must be there (null only for a number: NaN); an optional one's may be
// missing or null.
struct Reader {
  const Fields& f;
  void operator()(const char* key, int64_t& v) const {
    const std::optional<int64_t> read = f.integer(key);
    if (!read) f.missing(key, "a whole number >= 0");
    v = *read;
  }
  void operator()(const char* key, double& v) const { v = f.required_number(key); }
  void operator()(const char* key, std::string& v) const { v = f.required_text(key); }
  void operator()(const char* key, std::optional<double>& v) const { v = f.number(key); }
  void operator()(const char* key, std::optional<int64_t>& v) const { v = f.integer(key); }
  void operator()(const char* key, std::optional<uint64_t>& v) const { v = f.unsigned_integer(key); }
  void operator()(const char* key, std::optional<std::string>& v) const { v = f.text(key); }
  void operator()(const char* key, std::optional<bool>& v) const { v = f.boolean(key); }
  void operator()(const char* key, std::optional<json>& v, Shape shape) const {
    v = f.value(key, shape == Shape::memory ? Shape::object : shape);
    if (v && shape == Shape::memory) check_memory(*v, f.where());
  }
  void operator()(const char* key, std::optional<ResidentBytes>& v) const {
    const std::optional<json> bytes = f.object(key);
    if (!bytes) return;
    const Fields counts(*bytes, f.where(), str_cat(key_name(key), "."));
    const Reader inner{counts};
    v.emplace();
    inner("parameters", v->parameters);
    inner("gradients", v->gradients);
  }
};

template <class R>
json write_record(const R& record) {
  json out = json::object();
  visit_fields(record, Writer{out});
  return out;
}

template <class R>
R read_record(const json& record, const std::string& where) {
  R r;
  const Fields f(record, where);
  visit_fields(r, Reader{f});
  return r;
}

}  // namespace

MetricsRecordKind metrics_record_kind(const json& record) {
  if (!record.is_object()) return MetricsRecordKind::other;
  if (!record.contains("step")) {
    return record.contains("optimizer") ? MetricsRecordKind::start : MetricsRecordKind::other;
  }
  if (record.contains("anomaly")) return MetricsRecordKind::anomaly;
  if (record.contains("loss")) return MetricsRecordKind::step;
  if (record.contains("val_loss") || record.contains("val_reward") || record.contains("memory")) {
    return MetricsRecordKind::validation;
  }
  if (record.size() == 2) {
    for (const auto& [key, value] : record.items()) {
      if (key != "step" && value.is_object()) return MetricsRecordKind::objective;
    }
  }
  return MetricsRecordKind::other;
}

int64_t record_step(const json& record, const std::string& where) {
  int64_t step = 0;
  const Fields f(record, where);
  Reader{f}("step", step);
  return step;
}

// ---------------------------------------------------------------- the record kinds

json to_json(const StartRecord& record) { return write_record(record); }
json to_json(const StepRecord& record) { return write_record(record); }
json to_json(const ValidationRecord& record) { return write_record(record); }
json to_json(const AnomalyRecord& record) { return write_record(record); }

StartRecord parse_start_record(const json& record, const std::string& where) {
  return read_record<StartRecord>(record, where);
}
StepRecord parse_step_record(const json& record, const std::string& where) {
  return read_record<StepRecord>(record, where);
}
ValidationRecord parse_validation_record(const json& record, const std::string& where) {
  return read_record<ValidationRecord>(record, where);
}
AnomalyRecord parse_anomaly_record(const json& record, const std::string& where) {
  return read_record<AnomalyRecord>(record, where);
}

std::map<std::string, double> ValidationRecord::memory_peaks() const {
  std::map<std::string, double> peaks;
  if (!memory || !memory->is_object()) return peaks;
  for (const auto& [category, bytes] : memory->items()) {
    const auto it = bytes.is_object() ? bytes.find("peak") : bytes.end();
    peaks[category] = bytes.is_object() && it != bytes.end() && it->is_number() ? it->get<double>() : kNaN;
  }
  return peaks;
}

// ---------------------------------------------------------------- objective records

json to_json(const ObjectiveRecord& r) { return {{"step", r.step}, {r.key, r.fields}}; }

ObjectiveRecord parse_objective_record(const json& record, const std::string& where) {
  ObjectiveRecord r;
  r.step = record_step(record, where);
  LOOM_CHECK(record.size() == 2, where, ": expected {\"step\": N, \"<objective>\": {...}}, found ", quoted(record));
  for (const auto& [key, value] : record.items()) {
    if (key == "step") continue;
    if (!value.is_object()) Fields(record, where).wrong(key, value, "an object");
    r.key = key;
    r.fields = value;
  }
  return r;
}

// ---------------------------------------------------------------- what loom report charts

std::optional<double> objective_series_value(const ObjectiveSeries& series, const json& record,
                                             const std::string& where) {
  const Fields f(record, where);
  if (series.field.empty()) return f.number(series.record_key);
  const std::optional<json> fields = f.object(series.record_key);
  if (!fields) return std::nullopt;
  const Fields inner(*fields, where, str_cat(key_name(series.record_key), "."));
  const std::optional<double> v = inner.number(series.field);
  return v ? *v : kNaN;
}

std::string record_excerpt(std::string_view text, size_t max) {
  std::string out;
  for (const char c : text.substr(0, max)) out += (c >= 0x20 && c < 0x7F) ? c : '?';
  return text.size() > max ? out + "..." : out;
}

}  // namespace loom
