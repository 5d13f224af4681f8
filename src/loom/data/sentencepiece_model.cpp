// SentencePiece ModelProto fields from the protocol buffers wire format (sentencepiece_model.h).
#include "loom/data/sentencepiece_model.h"

#include <cstring>

#include "loom/core/error.h"

namespace loom {
namespace {

enum WireType : uint32_t { kVarint = 0, kFixed64 = 1, kLength = 2, kFixed32 = 5 };

// One message's fields in order; every read is bounds-checked.
class Fields {
 public:
  Fields(std::string_view bytes, const std::string& path, size_t base) : bytes_(bytes), path_(path), base_(base) {}

  // Reads the next key into (field, wire); false at the end of the message.
  bool next(uint32_t& field, uint32_t& wire) {
    if (pos_ == bytes_.size()) return false;
    const uint64_t key = varint();
    field = static_cast<uint32_t>(key >> 3), wire = static_cast<uint32_t>(key & 7);
    if (field == 0) fail("field number 0");
    return true;
  }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      need(1);
      const auto b = static_cast<uint8_t>(bytes_[pos_++]);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return v;
    }
    fail("varint longer than 10 bytes");
  }
  std::string_view length_delimited() {
    const uint64_t n = varint();
    need(n);
    const std::string_view v = bytes_.substr(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return v;
  }
  float fixed32_float() {
    need(4);
    float v = 0;
    std::memcpy(&v, bytes_.data() + pos_, 4);  // little-endian, as the wire format
    pos_ += 4;
    return v;
  }
  void skip(uint32_t wire) {
    switch (wire) {
      case kVarint: varint(); return;
      case kFixed64: need(8); pos_ += 8; return;
      case kLength: length_delimited(); return;
      case kFixed32: need(4); pos_ += 4; return;
      default: fail(str_cat("unsupported wire type ", wire));
    }
  }
  // The field's value must have `wire` type.
  void expect(uint32_t field, uint32_t wire, uint32_t expected) const {
    if (wire != expected) fail(str_cat("field ", field, " has wire type ", wire, ", expected ", expected));
  }
  // Where the message's current position is in the file, for nested messages.
  size_t offset() const { return base_ + pos_; }
  [[noreturn]] void fail(const std::string& what) const {
    throw Error(str_cat(path_, ": not a SentencePiece model: ", what, " at byte ", base_ + pos_));
  }

 private:
  void need(uint64_t n) const {
    if (n > bytes_.size() - pos_) fail(str_cat("a value of ", n, " bytes runs past the end"));
  }
  std::string_view bytes_;
  const std::string& path_;
  size_t base_;
  size_t pos_ = 0;
};

SentencePieceModel::Piece parse_piece(Fields& fields) {
  SentencePieceModel::Piece piece;
  uint32_t field = 0, wire = 0;
  while (fields.next(field, wire)) {
    if (field == 1) fields.expect(field, wire, kLength), piece.text = std::string(fields.length_delimited());
    else if (field == 2) fields.expect(field, wire, kFixed32), piece.score = fields.fixed32_float();
    else if (field == 3) fields.expect(field, wire, kVarint), piece.type = static_cast<int32_t>(fields.varint());
    else fields.skip(wire);
  }
  return piece;
}

void parse_trainer_spec(Fields& fields, SentencePieceModel& model) {
  uint32_t field = 0, wire = 0;
  while (fields.next(field, wire)) {
    if (field == 3) fields.expect(field, wire, kVarint), model.model_type = static_cast<int32_t>(fields.varint());
    else if (field == 24) fields.expect(field, wire, kVarint), model.treat_whitespace_as_suffix = fields.varint() != 0;
    else if (field == 35) fields.expect(field, wire, kVarint), model.byte_fallback = fields.varint() != 0;
    else fields.skip(wire);
  }
}

void parse_normalizer_spec(Fields& fields, SentencePieceModel& model) {
  uint32_t field = 0, wire = 0;
  while (fields.next(field, wire)) {
    if (field == 1) fields.expect(field, wire, kLength), model.normalizer_name = std::string(fields.length_delimited());
    else if (field == 2) fields.expect(field, wire, kLength), model.has_charsmap = !fields.length_delimited().empty();
    else if (field == 3) fields.expect(field, wire, kVarint), model.add_dummy_prefix = fields.varint() != 0;
    else if (field == 4) fields.expect(field, wire, kVarint), model.remove_extra_whitespaces = fields.varint() != 0;
    else if (field == 5) fields.expect(field, wire, kVarint), model.escape_whitespaces = fields.varint() != 0;
    else fields.skip(wire);
  }
}

}  // namespace

SentencePieceModel parse_sentencepiece_model(std::string_view bytes, const std::string& path) {
  SentencePieceModel model;
  Fields fields(bytes, path, 0);
  uint32_t field = 0, wire = 0;
  while (fields.next(field, wire)) {
    if (field < 1 || field > 3) {
      fields.skip(wire);
      continue;
    }
    fields.expect(field, wire, kLength);
    const std::string_view body = fields.length_delimited();
    Fields message(body, path, fields.offset() - body.size());
    if (field == 1) model.pieces.push_back(parse_piece(message));
    else if (field == 2) parse_trainer_spec(message, model);
    else parse_normalizer_spec(message, model);
  }
  return model;
}

}  // namespace loom
