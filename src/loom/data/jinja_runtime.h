// What the interpreter (jinja_eval.cpp) and the built-ins (jinja_filters.cpp) share.
#pragma once
#include <stdexcept>
#include <string>
#include <vector>

#include "loom/data/jinja.h"

namespace loom::jinja {

// A runtime error without a position; the interpreter adds the position of the node that failed.
struct RuntimeError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

size_t utf8_length(const std::string& s, size_t i);  // bytes of the character at i (1 if ill-formed)
uint32_t decode_utf8(const std::string& s, size_t i, size_t len);

// Evaluated call arguments: positional, then keyword in the order written.
struct Args {
  std::vector<Value> positional;
  Dict keyword;
  const Value* kw(const std::string& key) const;
  // positional[i], else keyword `key`, else nullptr.
  const Value* at(size_t i, const std::string& key) const;
};

// `operand | name` (args == nullptr) or `operand | name(args)`.
Value apply_filter(const std::string& name, const Value& operand, const Args* args);
// `operand is name`; `arg` is the second operand of equalto/eq (selectattr), or nullptr.
bool apply_test(const std::string& name, const Value& operand, const Value* arg);
bool has_test(const std::string& name);
// object.property / object[property]: items, attributes and the built-in methods.
Value member_of(const Value& object, const Value& property);
// Python slice semantics on arrays and (code points of) strings.
Value slice_of(const Value& object, const Value& start, const Value& stop, const Value& step);
// The built-in global functions: namespace, raise_exception, range, strftime_now.
Dict builtin_globals();

}  // namespace loom::jinja
