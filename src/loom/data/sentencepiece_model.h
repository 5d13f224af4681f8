// What a SentencePiece model file says beyond encoding and decoding: its pieces with their
// scores and types, and the trainer and normalizer settings that change how text is split.
// tokenizer.model is a serialized ModelProto (sentencepiece_model.proto, protocol buffers wire
// format: each field a varint key (field number << 3 | wire type) and its value: 0 varint,
// 1 fixed 64-bit, 2 length-delimited, 5 fixed 32-bit). Read here for the fields below only;
// SentencePieceTokenizer (libsentencepiece) encodes. Used by GGUF export (checkpoint/gguf_vocab.h).
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom {

struct SentencePieceModel {
  // ModelProto.SentencePiece.Type.
  enum PieceType : int32_t { kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6 };
  // TrainerSpec.ModelType.
  enum ModelType : int32_t { kUnigram = 1, kBpe = 2, kWord = 3, kChar = 4 };
  struct Piece {
    std::string text;  // field 1
    float score = 0;   // field 2
    int32_t type = kNormal;  // field 3
  };
  std::vector<Piece> pieces;  // ModelProto field 1, in id order
  // ModelProto.trainer_spec (field 2).
  int32_t model_type = kUnigram;            // field 3
  bool treat_whitespace_as_suffix = false;  // field 24
  bool byte_fallback = false;               // field 35
  // ModelProto.normalizer_spec (field 3).
  std::string normalizer_name;           // field 1
  bool has_charsmap = false;             // field 2 (precompiled_charsmap) not empty: the text is normalized
  bool add_dummy_prefix = true;          // field 3
  bool remove_extra_whitespaces = true;  // field 4
  bool escape_whitespaces = true;        // field 5
};

// Parses a serialized ModelProto; `path` names the file in errors ("<path>: not a SentencePiece
// model: ..."). Fields not listed above are skipped.
SentencePieceModel parse_sentencepiece_model(std::string_view bytes, const std::string& path);

}  // namespace loom
