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

// The limits of one rendering. A chat template is a program that comes with a model (a tokenizer
// folder, a --chat-template file): it may recurse, loop or grow strings without end, so every
// rendering runs within these, and one past any of them is an Error naming it (docs/tokenizers.md).
inline constexpr int kMaxCallDepth = 200;                    // macro calls in progress (recursion)
inline constexpr size_t kMaxStringBytes = size_t{16} << 20;  // any string: the output, and each one on the way
inline constexpr size_t kMaxItems = size_t{1} << 20;         // items of any list (range's too) or dict
inline constexpr int kMaxValueDepth = 200;                   // lists and dicts within each other
// Steps: every expression or statement evaluated and every macro call is one, a loop iteration
// kLoopSteps (its loop variable), and the values the interpreter makes, copies or scans one per
// kStepBytes bytes of strings (a list item or dict entry counting kItemBytes). At most kMaxSteps
// in a rendering: about a second, and a few hundred MB of values.
inline constexpr uint64_t kMaxSteps = 5'000'000;
inline constexpr uint64_t kStepBytes = 64;
inline constexpr uint64_t kItemBytes = 128;
inline constexpr uint64_t kLoopSteps = 16;

// RuntimeErrors naming the limit: a string of `bytes`, a list or dict of `items`, values `depth` deep.
void check_string_size(size_t bytes);
void check_items(size_t items);
void check_value_depth(int depth);
// The bytes of making or copying `v`: its string's, or kItemBytes an item and its items' strings.
uint64_t value_work(const Value& v);

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
