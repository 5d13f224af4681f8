#include "loom/checkpoint/model_config_json.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

#include "loom/core/error.h"

namespace loom {

namespace {

template <class T>
nlohmann::json to_json_value(const T& v) {
  if constexpr (std::is_same_v<T, Arch>) return std::string(arch_name(v));
  else if constexpr (kModelEnum<T>) return std::string(enum_name(v));
  else if constexpr (std::is_same_v<T, float>) return shortest_decimal(v);
  else return v;
}

template <class T>
void from_json_value(const nlohmann::json& j, T& v, const char* key) {
  if constexpr (std::is_same_v<T, Arch>) v = arch_from_name(j.get<std::string>());
  else if constexpr (std::is_same_v<T, RopeScaling>) v = parse_enum<RopeScaling>(j.get<std::string>(), "rope_scaling.type");
  else if constexpr (std::is_same_v<T, PeftMethod>) v = parse_enum<PeftMethod>(j.get<std::string>(), "peft.method");
  else if constexpr (kModelEnum<T>) v = parse_enum<T>(j.get<std::string>(), key);
  else if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
    // nlohmann casts a float such as 1e300 to the integer, undefined beyond its range.
    LOOM_CHECK(j.is_number_integer(), key, " is ", j.dump(), ", expected an integer");
    v = j.get<T>();
  } else if constexpr (std::is_floating_point_v<T>) {
    v = j.get<T>();  // 1e39 is a float's inf, which model_config_json could not write back (JSON has none)
    LOOM_CHECK(std::isfinite(v), key, " is ", j.dump(), ", expected a finite ", sizeof(T) == 4 ? "float" : "double");
  } else {
    v = j.get<T>();
  }
}

// The object a field lives in (nullptr: not written for this model).
const char* group_name(ModelField::Place place) {
  switch (place) {
    case ModelField::ROPE: return "rope_scaling";
    case ModelField::MLA: return "mla";
    case ModelField::MOE: return "moe";
    case ModelField::PEFT: return "peft";
    default: return nullptr;
  }
}

}  // namespace

// So the config in the file reads as the user wrote it and still round-trips bitwise.
double shortest_decimal(float f) {
  char buf[32];
  for (int digits = 6; digits < 9; ++digits) {
    std::snprintf(buf, sizeof(buf), "%.*g", digits, static_cast<double>(f));
    if (std::strtof(buf, nullptr) == f) return std::strtod(buf, nullptr);
  }
  std::snprintf(buf, sizeof(buf), "%.9g", static_cast<double>(f));
  return std::strtod(buf, nullptr);
}

nlohmann::json model_config_json(const ModelConfig& c) {
  nlohmann::json j = nlohmann::json::object();
  visit_model_fields(c, [&](const ModelField& f, const auto& value) {
    switch (f.place) {
      case ModelField::ALWAYS: j[f.json] = to_json_value(value); break;
      case ModelField::IF_SET:  // full-attention checkpoints keep their bytes
        if constexpr (std::is_arithmetic_v<std::decay_t<decltype(value)>>) {
          if (value != 0) j[f.json] = to_json_value(value);
        } else if constexpr (std::is_same_v<std::decay_t<decltype(value)>, std::string>) {
          if (!value.empty()) j[f.json] = value;
        } else if constexpr (kModelEnum<std::decay_t<decltype(value)>>) {
          if (value != std::decay_t<decltype(value)>{}) j[f.json] = to_json_value(value);  // the first name is the default
        }
        break;
      case ModelField::ROPE: if (c.rope_scaling != ROPE_SCALING_NONE) j["rope_scaling"][f.json] = to_json_value(value); break;
      case ModelField::MLA: if (c.mla()) j["mla"][f.json] = to_json_value(value); break;  // only for MLA models
      case ModelField::MOE: if (c.moe_experts > 0) j["moe"][f.json] = to_json_value(value); break;  // dense checkpoints keep their bytes
      case ModelField::PEFT: if (c.lora()) j["peft"][f.json] = to_json_value(value); break;  // only for adapted models
    }
  });
  return j;
}

ModelConfig model_config_from_json(const std::string& text, const std::string& path) {
  ModelConfig c;
  try {
    const nlohmann::json j = nlohmann::json::parse(text);
    visit_model_fields(c, [&](const ModelField& f, auto& value) {
      if (const char* group = group_name(f.place)) {
        // A key added to a group later (mla.score_scale) keeps its default in older checkpoints.
        if (j.contains(group) && j.at(group).contains(f.json)) from_json_value(j.at(group).at(f.json), value, f.json);
      } else if (f.place == ModelField::ALWAYS || j.contains(f.json)) {
        from_json_value(j.at(f.json), value, f.json);
      }
    });
    c.validate();
  } catch (const nlohmann::json::exception& e) {
    throw Error(str_cat(path, ": metadata 'model_config' is not a valid model config (", e.what(), ")"));
  } catch (const Error& e) {
    throw Error(str_cat(path, ": metadata 'model_config' is not a valid model config (", e.what(), ")"));
  }
  return c;
}

}  // namespace loom
