// metrics.jsonl's schema (train/metrics_schema.h): each record kind as `loom train` writes it
// (apps/loom/cmd_train.cpp's initializer lists, with the writer's C++ types) equals to_json of its
// struct, and survives dump -> parse -> to_json -> dump bitwise; wrong types are refused naming
// the file, line and key; what `loom report` tolerates (older files, nulls, newer keys) parses.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "loom/core/error.h"
#include "loom/train/metrics_schema.h"
#include "loom/train/objective.h"
#include "test_util.h"

namespace loom {
namespace {

using nlohmann::json;

const std::string kWhere = "runs/a/metrics.jsonl:7";

using test::error_of;  // the loom::Error's message, "" when none is thrown

// The written line equals to_json of the struct, and the line parsed and written again.
template <typename Record, typename Parse>
void expect_round_trip(const json& written, const Record& record, Parse parse) {
  const std::string line = written.dump();
  EXPECT_EQ(to_json(record).dump(), line);
  EXPECT_EQ(to_json(parse(json::parse(line), kWhere)).dump(), line);
}

// ledger_json and moe_json's shapes (apps/loom/train_output.cpp).
json comm_json() {
  return {{"world", {{"all_reduce", {{"calls", int64_t{12}}, {"sent", int64_t{98304}}, {"received", int64_t{98304}}}}}},
          {"tp", {{"all_gather", {{"calls", int64_t{4}}, {"sent", int64_t{1024}}, {"received", int64_t{3072}}}}}}};
}

json moe_json() {
  json layers = json::array();
  layers.push_back({{"layer", 1}, {"load", std::vector<int64_t>{10, 22, 0, 32}}, {"max_violation", 0.5},
                    {"entropy", 1.2345678901234}, {"tokens", int64_t{64}}, {"dropped", int64_t{0}}, {"aux", 0.01},
                    {"seq_aux", 0.0}, {"z", 1e-4}});
  return layers;
}

json memory_json() {  // size_t counts, as MemoryTracker's
  json j;
  j["parameters"] = {{"current", size_t{23282688}}, {"peak", size_t{23282688}}};
  j["activations"] = {{"current", size_t{0}}, {"peak", size_t{1} << 31}};
  j["kv_cache"] = {{"current", size_t{0}}, {"peak", size_t{0}}};
  return j;
}

TEST(MetricsSchema, StartRecordRoundTrips) {
  const int64_t n_params = 5820416, state_bytes = 46563328, step = 0;
  const std::string precision =
      "attn_qkv=bf16 attn_out=f32 mlp_in=bf16 mlp_out=bf16 head=f32 param=f32 reduce=f32 master=f32";
  const json written = {{"schema_version", kMetricsSchemaVersion}, {"event", "resume"}, {"start_step", step},
                        {"optimizer", "adamw"}, {"parameters", n_params}, {"optimizer_state_bytes", state_bytes},
                        {"state_bytes_per_param", static_cast<double>(state_bytes) / static_cast<double>(n_params)},
                        {"schedule", std::string("cosine")}, {"precision", precision}, {"loss_scaling", true},
                        {"mfu_peak_dtype", std::string("bf16")}, {"mfu_peak_gflops", 912.345678},
                        {"datasheet_peak_gflops", 0.0}};
  StartRecord r;
  r.event = "resume";
  r.start_step = step;
  r.optimizer = "adamw";
  r.parameters = n_params;
  r.optimizer_state_bytes = state_bytes;
  r.state_bytes_per_param = static_cast<double>(state_bytes) / static_cast<double>(n_params);
  r.schedule = "cosine";
  r.precision = precision;
  r.loss_scaling = true;
  r.mfu_peak_dtype = "bf16";
  r.mfu_peak_gflops = 912.345678;
  r.datasheet_peak_gflops = 0.0;
  expect_round_trip(written, r, parse_start_record);
  EXPECT_EQ(metrics_record_kind(written), MetricsRecordKind::start);
}

StepRecord written_step(json& written, double loss) {
  const int64_t step = 41, tokens = 2048, sent = 3'000'000'000, received = 2'999'999'999;
  const float loss_scale = 0.1f;  // a float, widened exactly to the double the file holds
  const size_t memory = 123456789;
  const int ranks = 4;
  written = {{"step", step}, {"loss", loss}, {"lr", 2.9999e-4}, {"grad_norm", 1.0625}, {"tokens", tokens},
             {"seconds", 0.4321}, {"loss_scale", loss_scale}, {"skipped", false}, {"tokens_per_s", 4739.6},
             {"mfu", 0.2512}, {"memory_bytes", memory}, {"ranks", ranks}, {"comm_bytes_sent", sent},
             {"comm_bytes_received", received}, {"comm", comm_json()},
             {"resident_bytes", {{"parameters", int64_t{23282688}}, {"gradients", int64_t{0}}}}, {"moe", moe_json()}};
  StepRecord r;
  r.step = step;
  r.loss = loss;
  r.lr = 2.9999e-4;
  r.grad_norm = 1.0625;
  r.tokens = tokens;
  r.seconds = 0.4321;
  r.loss_scale = loss_scale;
  r.skipped = false;
  r.tokens_per_s = 4739.6;
  r.mfu = 0.2512;
  r.memory_bytes = memory;
  r.ranks = ranks;
  r.comm_bytes_sent = sent;
  r.comm_bytes_received = received;
  r.comm = comm_json();
  r.resident_bytes = ResidentBytes{23282688, 0};
  r.moe = moe_json();
  return r;
}

TEST(MetricsSchema, StepRecordRoundTrips) {
  json written;
  const StepRecord r = written_step(written, 3.0517578125);
  expect_round_trip(written, r, parse_step_record);
  EXPECT_EQ(metrics_record_kind(written), MetricsRecordKind::step);
  // A diverged step: the loss is NaN, written as null, read back as NaN and written as null again.
  const StepRecord diverged = written_step(written, std::numeric_limits<double>::quiet_NaN());
  EXPECT_NE(written.dump().find("\"loss\":null"), std::string::npos);
  expect_round_trip(written, diverged, parse_step_record);
  EXPECT_TRUE(std::isnan(parse_step_record(json::parse(written.dump()), kWhere).loss));
}

TEST(MetricsSchema, ValidationRecordsRoundTrip) {
  const int64_t done = 200;
  ValidationRecord lm;
  lm.step = done;
  lm.val_loss = 3.87654;
  lm.memory = memory_json();
  expect_round_trip({{"step", done}, {"val_loss", 3.87654}, {"memory", memory_json()}}, lm, parse_validation_record);
  ValidationRecord grpo;  // GRPO's held-out greedy reward, and its first record, without memory
  grpo.step = done;
  grpo.val_reward = 0.4375;
  grpo.memory = memory_json();
  expect_round_trip({{"step", done}, {"val_reward", 0.4375}, {"memory", memory_json()}}, grpo, parse_validation_record);
  ValidationRecord start;
  start.val_reward = 0.125;
  const json first = {{"step", 0}, {"val_reward", 0.125}};
  expect_round_trip(first, start, parse_validation_record);
  EXPECT_EQ(metrics_record_kind(first), MetricsRecordKind::validation);

  const std::map<std::string, double> peaks = parse_validation_record(json::parse(json(
      {{"step", done}, {"val_loss", 1.0}, {"memory", memory_json()}}).dump()), kWhere).memory_peaks();
  EXPECT_EQ(peaks.at("parameters"), 23282688.0);
  EXPECT_EQ(peaks.at("activations"), 2147483648.0);
  EXPECT_EQ(peaks.size(), 3u);
}

TEST(MetricsSchema, AnomalyRecordRoundTrips) {
  const int64_t step = 31, next = 29;
  const json position = {{"epoch", 0}, {"index", 120}, {"seed", 1234}};
  const std::string action = "skipped; rolled back to the checkpoint of step 28";
  const json written = {{"step", step}, {"anomaly", "spike"}, {"loss", 384.9}, {"spike_z", 1806.0},
                        {"batch", position}, {"action", action}, {"next_step", next}};
  AnomalyRecord r;
  r.step = step;
  r.anomaly = "spike";
  r.loss = 384.9;
  r.spike_z = 1806.0;
  r.batch = position;
  r.action = action;
  r.next_step = next;
  expect_round_trip(written, r, parse_anomaly_record);
  EXPECT_EQ(metrics_record_kind(written), MetricsRecordKind::anomaly);  // not a step record, though it has "loss"
}

TEST(MetricsSchema, ObjectiveRecordsRoundTrip) {
  const int64_t step = 7;
  const json dpo = {{"pairs", int64_t{8}}, {"loss", 0.6931}, {"reward_chosen", 0.01}, {"reward_rejected", -0.02},
                    {"margin", 0.03}, {"accuracy", 0.625}};
  const json grpo = {{"reward", 0.25}, {"completions", int64_t{16}}, {"mean_length", 11.5}, {"kl", 0.0012},
                     {"rollout_seconds", 1.75}, {"train_seconds", 0.5}};
  for (const auto& [key, fields] : {std::pair<std::string, json>{"dpo", dpo}, {"val_dpo", dpo}, {"grpo", grpo}}) {
    const json written = {{"step", step}, {key, fields}};
    expect_round_trip(written, ObjectiveRecord{step, key, fields}, parse_objective_record);
    EXPECT_EQ(metrics_record_kind(written), MetricsRecordKind::objective) << key;
    EXPECT_EQ(parse_objective_record(written, kWhere).key, key);
  }
}

TEST(MetricsSchema, WrongTypesAreRefusedNamingFileLineAndKey) {
  json written;
  written_step(written, 2.5);
  // A step record as written with one key's value replaced (a JSON pointer), and the message.
  const std::vector<std::tuple<const char*, json, std::string>> cases = {
      {"/lr", "0.1", "\"lr\" is \"0.1\", expected a number"},
      {"/skipped", 1, "\"skipped\" is 1, expected true or false"},
      {"/step", -3, "\"step\" is -3, expected a whole number >= 0"},
      {"/memory_bytes", 1.5, "\"memory_bytes\" is 1.5, expected a whole number >= 0"},
      {"/resident_bytes/gradients", "x", "\"resident_bytes\".\"gradients\" is \"x\", expected a whole number >= 0"},
      {"/comm", json::array(), "\"comm\" is [], expected an object"},
      {"/moe", json::object(), "\"moe\" is {}, expected an array"},
  };
  for (const auto& [pointer, value, message] : cases) {
    json bad = written;
    bad[json::json_pointer(pointer)] = value;
    EXPECT_EQ(error_of([&] { parse_step_record(bad, kWhere); }), "runs/a/metrics.jsonl:7: " + message);
  }
  EXPECT_EQ(error_of([&] { parse_start_record({{"optimizer", 3}}, kWhere); }),
            "runs/a/metrics.jsonl:7: \"optimizer\" is 3, expected a string");
  EXPECT_EQ(error_of([&] { parse_validation_record({{"step", 1}, {"memory", {{"parameters", 5}}}}, kWhere); }),
            "runs/a/metrics.jsonl:7: \"memory\".\"parameters\" is 5, expected {\"current\", \"peak\"}");
  EXPECT_EQ(error_of([&] {
              parse_validation_record({{"step", 1}, {"memory", {{"parameters", {{"peak", -1}}}}}}, kWhere);
            }),
            "runs/a/metrics.jsonl:7: \"memory\".\"parameters\".\"peak\" is -1, expected a whole number >= 0");
  EXPECT_EQ(error_of([&] { parse_anomaly_record({{"step", 1}, {"anomaly", "spike"}, {"action", 2}}, kWhere); }),
            "runs/a/metrics.jsonl:7: \"action\" is 2, expected a string");
  EXPECT_EQ(error_of([&] { parse_objective_record({{"step", 1}, {"dpo", 0.5}}, kWhere); }),
            "runs/a/metrics.jsonl:7: \"dpo\" is 0.5, expected an object");
  // A long value is quoted short, on one line.
  EXPECT_EQ(error_of([&] { parse_step_record({{"step", 1}, {"loss", std::string(100, 'x') + "\n"}}, kWhere); }),
            "runs/a/metrics.jsonl:7: \"loss\" is \"" + std::string(29, 'x') + "..., expected a number");
}

// The broken variant: a step record without its loss is not a step record.
TEST(MetricsSchema, AStepRecordWithoutItsLossIsRefused) {
  json written;
  written_step(written, 2.5);
  written.erase("loss");
  EXPECT_EQ(error_of([&] { parse_step_record(written, kWhere); }),
            "runs/a/metrics.jsonl:7: \"loss\" is missing, expected a number");
  EXPECT_EQ(metrics_record_kind(written), MetricsRecordKind::other);
  EXPECT_EQ(error_of([&] { parse_step_record({{"loss", 1.0}}, kWhere); }),
            "runs/a/metrics.jsonl:7: \"step\" is missing, expected a whole number >= 0");
  EXPECT_EQ(error_of([&] { parse_anomaly_record({{"step", 3}, {"loss", 1.0}}, kWhere); }),
            "runs/a/metrics.jsonl:7: \"anomaly\" is missing, expected a string");
  EXPECT_EQ(error_of([&] { parse_objective_record({{"step", 3}, {"dpo", json::object()}, {"x", 1}}, kWhere); }),
            "runs/a/metrics.jsonl:7: expected {\"step\": N, \"<objective>\": {...}}, found "
            "{\"dpo\":{},\"step\":3,\"x\":1}");
}

// What `loom report` reads from files in the wild (tests/report_check.py's synthetic runs).
TEST(MetricsSchema, OlderFilesNullsAndNewerKeysAreRead) {
  // A start record from before schema_version, with a key of a newer loom.
  const StartRecord old =
      parse_start_record({{"optimizer", "adamw"}, {"parameters", 1000}, {"future", {1, 2}}}, kWhere);
  EXPECT_FALSE(old.schema_version);
  EXPECT_EQ(old.parameters, 1000);
  EXPECT_FALSE(old.precision);
  // A step record of only its step and loss; nulls are NaN for numbers, absent for the rest.
  const json nulls = {{"step", 3}, {"loss", 1.5}, {"lr", nullptr}, {"skipped", nullptr}, {"ranks", nullptr},
                      {"new_key", "x"}};
  const StepRecord minimal = parse_step_record(nulls, kWhere);
  EXPECT_TRUE(minimal.lr && std::isnan(*minimal.lr));
  EXPECT_FALSE(minimal.skipped);
  EXPECT_FALSE(minimal.ranks);
  EXPECT_FALSE(minimal.mfu);
  EXPECT_EQ(to_json(minimal).dump(), R"({"loss":1.5,"lr":null,"step":3})");
  // Whole numbers written as floats (a tool that rewrote the file through doubles).
  const StepRecord floats =
      parse_step_record({{"step", 3.0}, {"loss", 1.0}, {"memory_bytes", 1e8}, {"ranks", 2.0}}, kWhere);
  EXPECT_EQ(floats.step, 3);
  EXPECT_EQ(floats.memory_bytes, uint64_t{100000000});
  EXPECT_EQ(floats.ranks, 2);
  // Kinds: a record of no known kind is "other", for readers to skip.
  EXPECT_EQ(metrics_record_kind({{"step", 3}}), MetricsRecordKind::other);
  EXPECT_EQ(metrics_record_kind({{"step", 3}, {"x", 1}}), MetricsRecordKind::other);
  EXPECT_EQ(metrics_record_kind({{"event", "x"}}), MetricsRecordKind::other);
  EXPECT_EQ(metrics_record_kind(json::array()), MetricsRecordKind::other);
  EXPECT_EQ(metrics_record_kind({{"step", 3}, {"memory", json::object()}}), MetricsRecordKind::validation);
}

TEST(MetricsSchema, ObjectiveSeriesReadTheirValues) {
  const std::vector<ObjectiveSeries>& series = objective_series();  // the registry rows' (train/objective.h)
  ASSERT_EQ(series.size(), 8u);  // dpo, grpo, orpo, kto: two each
  const auto row = [&](const std::string& key) {
    for (const ObjectiveSeries& s : series) {
      if (s.record_key == key) return s;
    }
    ADD_FAILURE() << key;
    return ObjectiveSeries{};
  };
  EXPECT_EQ(objective_series_value(row("grpo"), {{"step", 4}, {"grpo", {{"reward", 0.75}}}}, kWhere), 0.75);
  EXPECT_EQ(objective_series_value(row("val_reward"), {{"step", 4}, {"val_reward", 0.5}}, kWhere), 0.5);
  EXPECT_EQ(objective_series_value(row("dpo"), {{"step", 4}, {"dpo", {{"accuracy", 0.625}}}}, kWhere), 0.625);
  EXPECT_EQ(row("dpo").scale, 100.0);
  EXPECT_TRUE(row("val_dpo").validation && !row("dpo").validation);
  EXPECT_EQ(row("val_dpo").chart_file, row("dpo").chart_file);
  // Not carried: nullopt; carried without the field: NaN.
  EXPECT_FALSE(objective_series_value(row("dpo"), {{"step", 4}, {"val_loss", 1.0}}, kWhere));
  EXPECT_FALSE(objective_series_value(row("dpo"), {{"step", 4}, {"dpo", nullptr}}, kWhere));
  EXPECT_TRUE(std::isnan(*objective_series_value(row("dpo"), {{"step", 4}, {"dpo", json::object()}}, kWhere)));
  EXPECT_EQ(error_of([&] { objective_series_value(row("grpo"), {{"step", 4}, {"grpo", {{"reward", "x"}}}}, kWhere); }),
            "runs/a/metrics.jsonl:7: \"grpo\".\"reward\" is \"x\", expected a number");
  EXPECT_EQ(error_of([&] { objective_series_value(row("val_reward"), {{"step", 4}, {"val_reward", {1}}}, kWhere); }),
            "runs/a/metrics.jsonl:7: \"val_reward\" is [1], expected a number");
}

}  // namespace
}  // namespace loom
