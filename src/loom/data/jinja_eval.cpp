// The interpreter of the Jinja subset: statements, expressions and operators, with the scoping
// and the operator typing of @huggingface/jinja.
#include <algorithm>
#include <cmath>
#include <memory>
#include <unordered_map>

#include "loom/core/error.h"
#include "loom/data/jinja.h"
#include "loom/data/jinja_runtime.h"

namespace loom::jinja {
namespace {

[[noreturn]] void fail(const std::string& what) { throw RuntimeError(what); }

struct Scope {
  std::unordered_map<std::string, Value> vars;
  const Scope* parent = nullptr;
  Value lookup(const std::string& name) const {
    for (const Scope* s = this; s != nullptr; s = s->parent) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return it->second;
    }
    return Value::undefined();
  }
};

enum class Flow { Normal, Break, Continue };

// Whether a macro's (or caller's) body reads `kwargs` / `varargs` without declaring them: then the
// extra keyword / positional arguments are bound to them instead of being refused.
struct SpecialArguments {
  bool kwargs = false, varargs = false;
};
void find_special_arguments(const Ast& n, std::vector<std::string>& declared, SpecialArguments& found) {
  auto declare = [&](const Ast& target) {
    if (target.type == Node::Ident || target.type == Node::KwArg) declared.push_back(target.text);
    for (const AstPtr& k : target.kids)
      if (target.type == Node::TupleLit && k) declared.push_back(k->text);
  };
  if (n.type == Node::Ident && std::find(declared.begin(), declared.end(), n.text) == declared.end()) {
    found.kwargs = found.kwargs || n.text == "kwargs";
    found.varargs = found.varargs || n.text == "varargs";
  }
  if ((n.type == Node::For || n.type == Node::Set) && !n.kids.empty() && n.kids[0]) declare(*n.kids[0]);
  if (n.type == Node::Macro)
    for (const AstPtr& k : n.kids) declare(*k);
  for (size_t i = 0; i < n.kids.size(); ++i) {
    const bool target = (n.type == Node::For || n.type == Node::Set) && i == 0;
    if (n.kids[i] && !target) find_special_arguments(*n.kids[i], declared, found);
  }
  for (const AstPtr& k : n.body) find_special_arguments(*k, declared, found);
  for (const AstPtr& k : n.alt) find_special_arguments(*k, declared, found);
}
SpecialArguments special_arguments(const std::vector<AstPtr>& params, size_t first, const std::vector<AstPtr>& body) {
  std::vector<std::string> declared;
  SpecialArguments found;
  for (size_t i = first; i < params.size(); ++i) declared.push_back(params[i]->text);
  for (size_t i = first; i < params.size(); ++i)
    if (params[i]->type == Node::KwArg) find_special_arguments(*params[i]->kids[0], declared, found);
  for (const AstPtr& k : body) find_special_arguments(*k, declared, found);
  return found;
}

// Runs one rendering within the limits of jinja_runtime.h: kMaxCallDepth, kMaxSteps (the nodes
// evaluated, loop iterations, macro calls and the values made, copied or scanned), and, where
// values are made, the string, item and depth limits.
class Interpreter {
 public:
  explicit Interpreter(const std::string& source) : source_(source) {}
  Interpreter(const Interpreter&) = delete;
  Interpreter& operator=(const Interpreter&) = delete;
  // A namespace may be made to hold itself or a chain longer than any limit on making values:
  // each one made is emptied at the end, one at a time, so none is freed recursively.
  ~Interpreter() {
    for (const std::shared_ptr<Dict>& ns : namespaces_) ns->clear();
  }
  void keep_namespace(const Value& ns) {
    if (ns.obj) namespaces_.push_back(ns.obj);
  }

  std::string program(const Ast& root, Scope& scope) {
    std::string out;
    try {
      out = block(root.body, scope);
    } catch (const RuntimeError& e) {
      fail_at(source_, root.pos, e.what());
    }
    if (flow_ != Flow::Normal) fail_at(source_, root.pos, "break or continue outside a for loop");
    return out;
  }

 private:
  // Evaluates a node; a runtime error becomes a loom::Error naming the innermost failing node.
  // Its steps: one, and the value it gives (a variable's or an item's string is copied, its list
  // shared).
  Value eval(const Ast& n, Scope& scope) {
    try {
      steps(1);
      Value v = eval_node(n, scope);
      const bool lookup = n.type == Node::Ident || (n.type == Node::Member && n.kids[1]->type != Node::Slice);
      charge(lookup ? v.str.size() : value_work(v));
      return v;
    } catch (const RuntimeError& e) {
      fail_at(source_, n.pos, e.what());
    }
  }
  // Counts `bytes` of values made, copied or scanned, and n steps.
  void charge(uint64_t bytes) {
    work_ += bytes;
    if (work_ > kMaxSteps * kStepBytes)
      fail(str_cat("more than ", kMaxSteps, " steps (the chat template's step limit: expressions evaluated, loop "
                   "iterations, macro calls and the data they make)"));
  }
  void steps(uint64_t n) { charge(n * kStepBytes); }
  Value eval_node(const Ast& n, Scope& scope);
  // The statements' output; empty, with flow_ set, when a break or continue cut it short.
  std::string block(const std::vector<AstPtr>& statements, Scope& scope) {
    std::string out;
    for (const AstPtr& s : statements) {
      const Value v = eval(*s, scope);
      if (flow_ != Flow::Normal) return {};
      if (v.kind == Kind::Null || v.kind == Kind::Undefined) continue;
      if (v.kind == Kind::String) check_string_size(out.size() + v.str.size());
      out += to_output(v);
      check_string_size(out.size());
    }
    return out;
  }
  Value binary(const Ast& n, Scope& scope);
  Value arithmetic(const std::string& op, const Value& a, const Value& b);
  Value member(const Ast& n, Scope& scope);
  Value call(const Ast& n, Scope& scope);
  Args arguments(const Ast& n, size_t first, Scope& scope);
  Value filter(const Ast& n, Scope& scope);
  Value select_attr(const Ast& call, const Value& operand, bool select, Scope& scope);
  Value set(const Ast& n, Scope& scope);
  Value macro(const Ast& n, Scope& scope);
  Value call_block(const Ast& n, Scope& scope);
  Value filter_block(const Ast& n, Scope& scope);
  Value invoke(const Ast& n, const std::string& name, size_t first_param, const SpecialArguments& special,
               std::vector<Value>& args, const Scope& parent);
  // Calls `fn` with the scope it is called from (a macro's body sees the caller's variables).
  Value call_function(const Value& fn, std::vector<Value>& args, const Scope& from) {
    const Scope* saved = calling_scope_;
    calling_scope_ = &from;
    struct Restore {
      const Scope*& slot;
      const Scope* value;
      ~Restore() { slot = value; }
    } restore{calling_scope_, saved};
    return (*fn.fn)(args);
  }
  Value for_loop(const Ast& n, Scope& scope);
  void bind(const Ast& var, const Value& item, Scope& scope);

  const std::string& source_;
  Flow flow_ = Flow::Normal;
  uint64_t work_ = 0;  // steps x kStepBytes
  const Scope* calling_scope_ = nullptr;
  int call_depth_ = 0;
  std::vector<std::shared_ptr<Dict>> namespaces_;
};

Value Interpreter::eval_node(const Ast& n, Scope& scope) {
  switch (n.type) {
    case Node::Program: return Value::string(block(n.body, scope));
    case Node::Text:
    case Node::Str: return Value::string(n.text);
    case Node::Comment: return Value::null();
    case Node::Int: return Value::integer(n.num);
    case Node::Float: return Value::floating(n.num);
    case Node::Ident: return scope.lookup(n.text);
    case Node::ArrayLit:
    case Node::TupleLit: {
      List items;
      for (const AstPtr& k : n.kids) items.push_back(eval(*k, scope));
      return Value::array(std::move(items), n.type == Node::TupleLit ? Kind::Tuple : Kind::Array);
    }
    case Node::ObjectLit: {
      Value obj = Value::object({});
      for (size_t i = 0; i + 1 < n.kids.size(); i += 2) {
        const Value key = eval(*n.kids[i], scope);
        if (key.kind != Kind::String) fail(str_cat("Dict keys must be strings: got ", kind_name(key.kind)));
        obj.set(key.str, eval(*n.kids[i + 1], scope));
      }
      return obj;
    }
    case Node::Member: return member(n, scope);
    case Node::Call: return call(n, scope);
    case Node::Unary: {
      const Value v = eval(*n.kids[0], scope);
      if (n.text == "not") return Value::boolean(!truthy(v));
      if (!v.is_number() && v.kind != Kind::Bool) fail(str_cat("Unknown operator \"", n.text, "\" for ", kind_name(v.kind)));
      const double x = (n.text == "-" ? -1 : 1) * (v.kind == Kind::Bool ? (v.b ? 1 : 0) : v.num);
      return v.kind == Kind::Float ? Value::floating(x) : Value::integer(x);
    }
    case Node::Binary: return binary(n, scope);
    case Node::Filter: return filter(n, scope);
    case Node::Test: {
      const Value v = eval(*n.kids[0], scope);
      if (!has_test(n.text)) fail("Unknown test: " + n.text);
      charge(value_work(v));
      return Value::boolean(apply_test(n.text, v, nullptr) != n.flag);
    }
    case Node::Select: return truthy(eval(*n.kids[1], scope)) ? eval(*n.kids[0], scope) : Value::undefined();
    case Node::Ternary: return truthy(eval(*n.kids[0], scope)) ? eval(*n.kids[1], scope) : eval(*n.kids[2], scope);
    case Node::If: {
      const bool test = truthy(eval(*n.kids[0], scope));
      return Value::string(block(test ? n.body : n.alt, scope));
    }
    case Node::For: return for_loop(n, scope);
    case Node::Set: return set(n, scope);
    case Node::Macro: return macro(n, scope);
    case Node::CallBlock: return call_block(n, scope);
    case Node::FilterBlock: return filter_block(n, scope);
    case Node::Break:
    case Node::Continue: flow_ = n.type == Node::Break ? Flow::Break : Flow::Continue; return Value::undefined();
    case Node::Slice:
    case Node::KwArg:
    case Node::Spread: break;
  }
  fail("a slice or keyword argument is not an expression here");
}

Value Interpreter::binary(const Ast& n, Scope& scope) {
  const std::string& op = n.text;
  const Value left = eval(*n.kids[0], scope);
  if (op == "and") return truthy(left) ? eval(*n.kids[1], scope) : left;
  if (op == "or") return truthy(left) ? left : eval(*n.kids[1], scope);
  const Value right = eval(*n.kids[1], scope);
  charge(value_work(left) + value_work(right));  // (compared, scanned or copied)
  if (op == "==") return Value::boolean(loose_equal(left, right));
  if (op == "!=") return Value::boolean(!loose_equal(left, right));
  const bool membership = op == "in" || op == "not in";
  if (left.kind == Kind::Undefined || right.kind == Kind::Undefined) {
    if (right.kind == Kind::Undefined && membership) return Value::boolean(op == "not in");
    fail(str_cat("Cannot perform operation ", op, " on undefined values"));
  }
  if (left.kind == Kind::Null || right.kind == Kind::Null) fail("Cannot perform operation on null values");
  const auto concat = [](const Value& a, const Value& b) {
    std::string x = to_concat(a);
    const std::string y = to_concat(b);
    check_string_size(x.size() + y.size());
    return Value::string(x += y);
  };
  if (op == "~") return concat(left, right);
  if (Value v = arithmetic(op, left, right); v.kind != Kind::Undefined) return v;
  if (left.is_array() && right.is_array()) {
    if (op == "+") {
      check_items(left.arr->size() + right.arr->size());
      List items = *left.arr;
      items.insert(items.end(), right.arr->begin(), right.arr->end());
      return Value::array(std::move(items));
    }
  } else if (right.is_array() && membership) {
    bool found = false;
    for (const Value& x : *right.arr) found = found || strict_equal(x, left);
    return Value::boolean(found == (op == "in"));
  }
  if ((left.kind == Kind::String || right.kind == Kind::String) && op == "+") return concat(left, right);
  if (left.kind == Kind::String && right.kind == Kind::String && membership)
    return Value::boolean((right.str.find(left.str) != std::string::npos) == (op == "in"));
  if (left.kind == Kind::String && right.is_object() && membership)
    return Value::boolean((right.get(left.str) != nullptr) == (op == "in"));
  fail(str_cat("Unknown operator \"", op, "\" between ", kind_name(left.kind), " and ", kind_name(right.kind)));
}

// Numbers: + - * keep integers, / gives a float, // floors, % is JavaScript's remainder.
// Undefined when the operands are not both numbers.
Value Interpreter::arithmetic(const std::string& op, const Value& left, const Value& right) {
  auto numeric_like = [](const Value& v) { return v.is_number() || v.kind == Kind::Bool; };
  auto num = [](const Value& v) { return v.kind == Kind::Bool ? (v.b ? 1.0 : 0.0) : v.num; };
  if (op == "**" && numeric_like(left) && numeric_like(right)) {
    const double a = num(left), b = num(right);
    if (a == 0 && b < 0) fail("0.0 cannot be raised to a negative power");
    const double r = std::pow(a, b);
    if (!std::isfinite(r)) fail("Exponentiation result is not a finite real number");
    return left.kind == Kind::Float || right.kind == Kind::Float || b < 0 ? Value::floating(r) : Value::integer(r);
  }
  if (!left.is_number() || !right.is_number()) return Value::undefined();
  const double a = left.num, b = right.num;
  const bool is_float = left.kind == Kind::Float || right.kind == Kind::Float;
  auto typed = [is_float](double r) { return is_float ? Value::floating(r) : Value::integer(r); };
  if (op == "+") return typed(a + b);
  if (op == "-") return typed(a - b);
  if (op == "*") return typed(a * b);
  if (op == "/") return Value::floating(a / b);
  if (op == "//") return typed(std::floor(a / b));
  if (op == "%") return typed(std::fmod(a, b));
  if (op == "<") return Value::boolean(a < b);
  if (op == ">") return Value::boolean(a > b);
  if (op == "<=") return Value::boolean(a <= b);
  if (op == ">=") return Value::boolean(a >= b);
  return Value::undefined();
}

Value Interpreter::member(const Ast& n, Scope& scope) {
  const Value object = eval(*n.kids[0], scope);
  charge(object.str.size());  // (a string's characters are counted or copied)
  const Ast& prop = *n.kids[1];
  if (n.flag && prop.type == Node::Slice) {
    auto part = [&](size_t i) { return prop.kids[i] ? eval(*prop.kids[i], scope) : Value::undefined(); };
    const Value start = part(0), stop = part(1), step = part(2);
    return slice_of(object, start, stop, step);
  }
  const Value key = n.flag ? eval(prop, scope) : prop.type == Node::Int ? Value::integer(prop.num) : Value::string(prop.text);
  return member_of(object, key);
}

// Positional arguments (and the items of a *list) first, then keyword arguments (and the
// entries of a **dict), each evaluated in that order.
Args Interpreter::arguments(const Ast& n, size_t first, Scope& scope) {
  Args args;
  for (size_t i = first; i < n.kids.size(); ++i) {
    const Ast& k = *n.kids[i];
    if (k.type == Node::Spread && !k.flag) {
      const Value list = eval(*k.kids[0], scope);
      if (!list.is_array()) fail(str_cat("Cannot unpack non-iterable type: ", kind_name(list.kind)));
      args.positional.insert(args.positional.end(), list.arr->begin(), list.arr->end());
    } else if (k.type != Node::KwArg && k.type != Node::Spread) {
      args.positional.push_back(eval(k, scope));
    }
  }
  auto add = [&](const std::string& key, Value v) {
    if (args.kw(key)) fail(str_cat("Got multiple values for keyword argument '", key, "'"));
    args.keyword.emplace_back(key, std::move(v));
  };
  for (size_t i = first; i < n.kids.size(); ++i) {
    const Ast& k = *n.kids[i];
    if (k.type == Node::KwArg) {
      add(k.text, eval(*k.kids[0], scope));
    } else if (k.type == Node::Spread && k.flag) {
      const Value dict = eval(*k.kids[0], scope);
      if (!dict.is_object() && dict.kind != Kind::Namespace)
        fail(str_cat("Argument after ** must be a mapping, not ", kind_name(dict.kind)));
      for (const auto& [key, value] : *dict.obj) add(key, value);
    }
  }
  return args;
}

Value Interpreter::call(const Ast& n, Scope& scope) {
  Args args = arguments(n, 1, scope);
  for (const Value& a : args.positional) charge(value_work(a));  // (copied to the callee)
  for (const auto& [k, a] : args.keyword) charge(value_work(a));
  const Value fn = eval(*n.kids[0], scope);
  if (fn.kind != Kind::Function) fail(str_cat("Cannot call something that is not a function: got ", kind_name(fn.kind)));
  std::vector<Value> all = std::move(args.positional);
  if (!args.keyword.empty()) all.push_back(Value::object(std::move(args.keyword), Kind::KwArgs));
  return call_function(fn, all, scope);
}

// {% macro name(params) %}: `name` becomes a function of the current scope rendering the body in
// a scope over the one it is called from, as the reference does.
Value Interpreter::macro(const Ast& n, Scope& scope) {
  const SpecialArguments special = special_arguments(n.kids, 0, n.body);
  const Ast* node = &n;
  scope.vars[n.text] = Value::function([this, node, special](std::vector<Value>& args) {
    return invoke(*node, "'" + node->text + "'", 0, special, args, *calling_scope_);
  });
  return Value::null();
}

// Binds the arguments to the parameters n.kids[first_param...] (positional, then by name, then
// the defaults, evaluated once every parameter is bound) and renders n.body.
Value Interpreter::invoke(const Ast& n, const std::string& name, size_t first_param, const SpecialArguments& special,
                          std::vector<Value>& args, const Scope& parent) {
  if (call_depth_ >= kMaxCallDepth)
    fail(str_cat("macro calls nested more than ", kMaxCallDepth, " deep (the chat template's recursion limit)"));
  steps(1);
  ++call_depth_;
  struct Leave {
    int& depth;
    ~Leave() { --depth; }
  } leave{call_depth_};
  std::vector<Value> positional = args;
  Dict keyword;
  if (!positional.empty() && positional.back().kind == Kind::KwArgs) {
    keyword = *positional.back().obj;
    positional.pop_back();
  }
  Scope scope{{}, &parent};
  std::vector<const Ast*> defaults;
  for (size_t i = first_param; i < n.kids.size(); ++i) {
    const Ast& param = *n.kids[i];
    const size_t index = i - first_param;
    Value value;
    bool given = index < positional.size();
    if (given) {
      value = positional[index];
    } else {
      const auto it = std::find_if(keyword.begin(), keyword.end(), [&](const auto& kv) { return kv.first == param.text; });
      if (it != keyword.end()) {
        value = it->second;
        keyword.erase(it);
        given = true;
      }
    }
    if (!given && param.type == Node::KwArg) defaults.push_back(&param);
    scope.vars[param.text] = value;
  }
  const size_t count = n.kids.size() - first_param;
  if (special.kwargs) scope.vars["kwargs"] = Value::object(std::move(keyword));
  else if (!keyword.empty()) fail(str_cat("macro ", name, " takes no keyword argument '", keyword.front().first, "'"));
  if (special.varargs) scope.vars["varargs"] = Value::array(List(positional.begin() + std::min(count, positional.size()), positional.end()));
  else if (positional.size() > count) fail(str_cat("macro ", name, " takes not more than ", count, " argument(s)"));
  for (const Ast* param : defaults) scope.vars[param->text] = eval(*param->kids[0], scope);
  return Value::string(block(n.body, scope));
}

// {% call[(params)] macro(args) %}body{% endcall %}: the macro runs with `caller`, a function
// rendering the body with its own parameters bound, in a scope over the call block's.
Value Interpreter::call_block(const Ast& n, Scope& scope) {
  const SpecialArguments special = special_arguments(n.kids, 1, n.body);
  // The caller may be kept past the block (in a namespace): it then refuses to run, its scope gone.
  const auto alive = std::make_shared<bool>(true);
  struct Expire {
    std::shared_ptr<bool> flag;
    ~Expire() { *flag = false; }
  } expire{alive};
  const Ast* node = &n;
  const Scope* home = &scope;
  const Value caller = Value::function([this, node, special, alive, home](std::vector<Value>& args) {
    if (!*alive) fail("caller() used after its call block ended");
    return invoke(*node, "None", 1, special, args, *home);
  });
  const Ast& call = *n.kids[0];
  Args args = arguments(call, 1, scope);
  std::vector<Value> all = std::move(args.positional);
  all.push_back(Value::object(std::move(args.keyword), Kind::KwArgs));
  const Value fn = eval(*call.kids[0], scope);
  if (fn.kind != Kind::Function) fail(str_cat("Cannot call something that is not a function: got ", kind_name(fn.kind)));
  Scope with_caller{{{"caller", caller}}, &scope};
  return call_function(fn, all, with_caller);
}

// {% filter f %}body{% endfilter %}: the body's output through f.
Value Interpreter::filter_block(const Ast& n, Scope& scope) {
  const Value rendered = Value::string(block(n.body, scope));
  if (flow_ != Flow::Normal) return Value::null();
  const Ast& f = *n.kids[0];
  if (f.type == Node::Ident) return apply_filter(f.text, rendered, nullptr);
  const Args args = arguments(f, 1, scope);
  return apply_filter(f.kids[0]->text, rendered, &args);
}

Value Interpreter::filter(const Ast& n, Scope& scope) {
  const Value operand = eval(*n.kids[0], scope);
  const Ast& f = *n.kids[1];
  // A filter reads its operand once; a sort about log2(n) times.
  const std::string& name0 = f.type == Node::Call && !f.kids.empty() ? f.kids[0]->text : f.text;
  uint64_t passes = 1;
  if (name0 == "sort" && operand.arr)
    for (size_t k = operand.arr->size(); k > 1; k /= 2) ++passes;
  charge(value_work(operand) * passes);
  if (f.type == Node::Ident) return apply_filter(f.text, operand, nullptr);
  if (f.type != Node::Call || f.kids[0]->type != Node::Ident) fail("Unknown filter");
  const std::string& name = f.kids[0]->text;
  if (operand.is_array() && (name == "selectattr" || name == "rejectattr")) return select_attr(f, operand, name == "selectattr", scope);
  const Args args = arguments(f, 1, scope);
  return apply_filter(name, operand, &args);
}

// items | selectattr("attr"[, "test"[, "value"]]): string literal arguments only.
Value Interpreter::select_attr(const Ast& call, const Value& operand, bool select, Scope& scope) {
  for (const Value& item : *operand.arr)
    if (item.kind != Kind::Object && item.kind != Kind::KwArgs && item.kind != Kind::Namespace)
      fail(str_cat("`", select ? "selectattr" : "rejectattr", "` can only be applied to array of objects"));
  std::vector<Value> args;
  for (size_t i = 1; i < call.kids.size(); ++i) {
    if (call.kids[i]->type != Node::Str) fail("arguments of selectattr/rejectattr must be strings");
    args.push_back(eval(*call.kids[i], scope));
  }
  if (args.empty()) fail("selectattr/rejectattr need an attribute name");
  if (args.size() > 1 && !has_test(args[1].str)) fail("Unknown test: " + args[1].str);
  List out;
  for (const Value& item : *operand.arr) {
    const Value* a = item.get(args[0].str);
    const bool result = a && (args.size() > 1 ? apply_test(args[1].str, *a, args.size() > 2 ? &args[2] : nullptr) : truthy(*a));
    if (result == select) out.push_back(item);
  }
  return Value::array(std::move(out));
}

Value Interpreter::set(const Ast& n, Scope& scope) {
  Value rhs;
  if (n.kids.size() > 1) {
    rhs = eval(*n.kids[1], scope);
  } else {
    rhs = Value::string(block(n.body, scope));
    if (flow_ != Flow::Normal) return Value::null();
  }
  const Ast& target = *n.kids[0];
  if (target.type == Node::Ident) {
    scope.vars[target.text] = rhs;
  } else if (target.type == Node::TupleLit) {
    if (!rhs.is_array()) fail(str_cat("Cannot unpack non-iterable type in set: ", kind_name(rhs.kind)));
    if (rhs.arr->size() != target.kids.size())
      fail(str_cat("Too ", target.kids.size() > rhs.arr->size() ? "few" : "many", " items to unpack in set"));
    for (size_t i = 0; i < target.kids.size(); ++i) {
      if (target.kids[i]->type != Node::Ident) fail("Cannot unpack to non-identifier in set");
      scope.vars[target.kids[i]->text] = (*rhs.arr)[i];
    }
  } else if (target.type == Node::Member) {
    Value object = eval(*target.kids[0], scope);
    if (object.kind != Kind::Namespace) fail("cannot assign attribute on non-namespace object");
    if (target.kids[1]->type != Node::Ident) fail("Cannot assign to member with non-identifier property");
    charge(object.obj->size() * kItemBytes);  // (its keys are searched)
    object.set(target.kids[1]->text, rhs);
  } else {
    fail("Invalid left-hand side of an assignment");
  }
  return Value::null();
}

void Interpreter::bind(const Ast& var, const Value& item, Scope& scope) {
  if (var.type == Node::Ident) {
    scope.vars[var.text] = item;
    return;
  }
  if (item.kind != Kind::Array) fail(str_cat("Cannot unpack non-iterable type: ", kind_name(item.kind)));
  if (var.kids.size() != item.arr->size())
    fail(str_cat("Too ", var.kids.size() > item.arr->size() ? "few" : "many", " items to unpack"));
  for (size_t j = 0; j < var.kids.size(); ++j) {
    if (var.kids[j]->type != Node::Ident) fail("Cannot unpack non-identifier type");
    scope.vars[var.kids[j]->text] = (*item.arr)[j];
  }
}

Value Interpreter::for_loop(const Ast& n, Scope& outer) {
  Scope scope{{}, &outer};
  const Ast& var = *n.kids[0];
  const Ast& source = *n.kids[1];
  const Ast* test = source.type == Node::Select ? source.kids[1].get() : nullptr;
  Value iterable = eval(test ? *source.kids[0] : source, scope);
  if (iterable.is_object()) {
    List keys;
    for (const auto& entry : *iterable.obj) keys.push_back(Value::string(entry.first));
    iterable = Value::array(std::move(keys));
  }
  if (!iterable.is_array()) fail(str_cat("Expected iterable or object type in for loop: got ", kind_name(iterable.kind)));
  charge(value_work(iterable));  // (its items are copied)
  List items;
  for (const Value& item : *iterable.arr) {
    steps(1);
    if (var.type != Node::Ident && item.kind != Kind::Array) fail(str_cat("Cannot unpack non-iterable type: ", kind_name(item.kind)));
    if (test) {
      Scope item_scope{{}, &scope};
      bind(var, item, item_scope);
      if (!truthy(eval(*test, item_scope))) continue;
    }
    items.push_back(item);
  }
  std::string out;
  bool none = true;
  const double len = static_cast<double>(items.size());
  for (size_t i = 0; i < items.size(); ++i) {
    steps(kLoopSteps);  // (the loop variable's nine entries)
    const double k = static_cast<double>(i);
    scope.vars["loop"] = Value::object({{"index", Value::integer(k + 1)},
                                        {"index0", Value::integer(k)},
                                        {"revindex", Value::integer(len - k)},
                                        {"revindex0", Value::integer(len - k - 1)},
                                        {"first", Value::boolean(i == 0)},
                                        {"last", Value::boolean(i + 1 == items.size())},
                                        {"length", Value::integer(len)},
                                        {"previtem", i > 0 ? items[i - 1] : Value::undefined()},
                                        {"nextitem", i + 1 < items.size() ? items[i + 1] : Value::undefined()}});
    bind(var, items[i], scope);
    const std::string body = block(n.body, scope);
    if (flow_ == Flow::Continue) {
      flow_ = Flow::Normal;
      continue;
    }
    if (flow_ == Flow::Break) {
      flow_ = Flow::Normal;
      break;
    }
    check_string_size(out.size() + body.size());
    out += body;
    none = false;
  }
  if (none) out += block(n.alt, scope);
  return Value::string(out);
}

}  // namespace

std::string render(const Ast& program, const std::string& source, const Dict& globals) {
  Scope scope;
  for (auto& [name, value] : builtin_globals()) scope.vars[name] = value;
  for (const auto& [name, value] : globals) {
    if (scope.vars.count(name)) throw Error(str_cat("chat template: the variable ", name, " is already declared"));
    scope.vars[name] = value;
  }
  Interpreter interpreter(source);
  // namespace(...): the built-in, each namespace made kept to be emptied at the end.
  const Value make_namespace = scope.vars["namespace"];
  scope.vars["namespace"] = Value::function([make_namespace, &interpreter](std::vector<Value>& args) {
    Value ns = (*make_namespace.fn)(args);
    interpreter.keep_namespace(ns);
    return ns;
  });
  return interpreter.program(program, scope);
}

}  // namespace loom::jinja
