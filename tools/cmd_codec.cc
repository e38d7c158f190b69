// CLI: `info`, `kv synth`, `codec encode|decode|compare|bench`.
#include <cstdio>
#include <nlohmann/json.hpp>
#include <thread>

#include "cli.h"
#include "kvserve/codec.h"
#include "kvserve/codec_bench.h"
#include "kvserve/cpu.h"
#include "kvserve/file.h"
#include "kvserve/frame.h"
#include "kvserve/synth.h"

namespace kvserve::cli {
namespace {

using json = nlohmann::json;

const std::vector<std::string> kDefaultBenchStrategies = {
    "quant(kbits=8,vbits=8)", "quant(kbits=8,vbits=8)|zstd(level=3)",
    "quant(kbits=4,vbits=4)", "quant(kbits=4,vbits=4)|zstd(level=3)",
    "quant(kbits=2,vbits=2)", "quant(kbits=2,vbits=2)|zstd(level=3)",
    "prune(keep=0.5)|quant(kbits=4,vbits=4)|rans",
};

// `codec bench --paged`: every strategy from and into a paged token-major cache against the dense
// block, one thread, in one run.
Status PagedBench(const std::vector<std::string>& given, uint32_t tokens, const std::string& dtype_name, int runs,
                  uint32_t block_size, bool as_json) {
  const std::vector<std::string> list =
      given.empty() ? std::vector<std::string>{"quant(kbits=4,vbits=4)", "fp8"} : given;
  for (const auto& s : list) KV_RETURN_IF_ERROR(CanonicalStrategy(s).status());
  KV_ASSIGN_OR_RETURN(DType dtype, ParseDType(dtype_name));
  KV_ASSIGN_OR_RETURN(KvBlock block, BenchBlock(tokens, Pool(2), dtype));
  Progress progress("codec bench --paged", list.size() + 1);
  const double memcpy_gbps = MeasureMemcpyGbps(block.bytes(), runs);
  progress.Update(1, "memcpy");
  BenchOptions bo;
  bo.runs = runs;
  bo.env = Codec();
  std::vector<PagedMeasurement> rows;
  for (const auto& spec : list) {
    KV_ASSIGN_OR_RETURN(PagedMeasurement m, MeasurePaged(block, spec, bo, block_size));
    rows.push_back(m);
    progress.Update(rows.size() + 1, m.spec);
  }
  progress.Done();
  auto footprint = [](const PagedMeasurement& m) {
    return m.added_peak_bytes < 0 ? -1.0
                                  : double(m.cache_bytes + m.added_peak_bytes) / double(m.cache_bytes + m.frame_bytes);
  };
  if (as_json) {
    json j;
    j["block"] = {{"shape", block.shape().ToString()}, {"dtype", DTypeName(dtype)}, {"bytes", block.bytes()},
                  {"block_size", block_size}};
    j["runs"] = runs;
    j["memcpy_gbps"] = memcpy_gbps;
    j["strategies"] = json::array();
    for (const auto& m : rows) {
      j["strategies"].push_back({{"spec", m.spec},
                                 {"dense_encode_gbps", m.dense_encode_gbps},
                                 {"dense_decode_gbps", m.dense_decode_gbps},
                                 {"paged_encode_gbps", m.paged_encode_gbps},
                                 {"paged_decode_gbps", m.paged_decode_gbps},
                                 {"encode_paged_vs_dense", m.paged_encode_gbps / m.dense_encode_gbps},
                                 {"decode_paged_vs_dense", m.paged_decode_gbps / m.dense_decode_gbps},
                                 {"same_frame", m.same_frame},
                                 {"frame_bytes", m.frame_bytes},
                                 {"cache_bytes", m.cache_bytes},
                                 {"added_peak_bytes", m.added_peak_bytes},
                                 {"footprint_vs_frame_plus_cache", footprint(m)}});
    }
    std::printf("%s\n", j.dump(2).c_str());
    return Status::Ok();
  }
  std::printf("block: llama3-8b %s %s, %.1f MiB, pages of %u tokens (shuffled); median of %d runs, one thread\n",
              block.shape().ToString().c_str(), DTypeName(dtype), block.bytes() / 1048576.0, block_size, runs);
  std::printf("memcpy %.2f GB/s\n\n", memcpy_gbps);
  std::printf("%-44s %17s %17s %13s %10s %12s\n", "strategy", "enc dense/paged", "dec dense/paged", "paged/dense",
              "same frame", "mem/(f+c)");
  for (const auto& m : rows) {
    std::printf("%-44s %7.2f / %7.2f %7.2f / %7.2f   %4.2f / %4.2f %10s %12.3f\n", m.spec.c_str(), m.dense_encode_gbps,
                m.paged_encode_gbps, m.dense_decode_gbps, m.paged_decode_gbps, m.paged_encode_gbps / m.dense_encode_gbps,
                m.paged_decode_gbps / m.dense_decode_gbps, m.same_frame ? "yes" : "NO", footprint(m));
  }
  std::printf("\nmem/(f+c): (cache + memory the paged runs added at their peak) / (frame + cache); a dense copy "
              "of the block would add about one cache\n");
  return Status::Ok();
}

Status Info() {
  std::printf("kvserve %s\n\nstages (strategy spec: stage(key=value,...)|stage(...); 'none' = no compression):\n",
              KVSERVE_VERSION);
  for (const StageInfo& s : RegisteredStages()) {
    std::printf("\n  %-8s %s -> %s%s\n           %s\n", s.name.c_str(), DataKindName(s.input), DataKindName(s.output),
                s.lossless ? ", lossless" : "", s.summary.c_str());
    for (const ParamSpec& p : s.params) {
      std::printf("           %-10s %-18s default %-8s %s\n", p.name.c_str(), p.RangeText().c_str(),
                  p.default_value.c_str(), p.help.c_str());
    }
  }
  std::printf("\nsimd: %s kernels (this CPU supports %s; KVSERVE_SIMD=baseline|avx2|avx512 caps it)\n",
              cpu::TierName(cpu::Active()), cpu::TierName(cpu::Detected()));
  return Status::Ok();
}

json StatsJson(const KvErrorStats& s) {
  return {{"max_abs", s.max_abs}, {"mean_abs", s.mean_abs}, {"snr_db", s.snr_db}, {"cosine", s.cosine}};
}

Result<KvBlock> ReadAnyFrame(const std::string& path) {
  KV_ASSIGN_OR_RETURN(ByteBuffer bytes, ReadFile(path));
  KvBlock b;
  Status st = DecodeKv(bytes, &b, {}, Codec());
  if (!st.ok()) return st.WithContext("'" + path + "'");
  return b;
}

}  // namespace

void AddCodecCommands(CLI::App& app) {
  SetAction(app.add_subcommand("info", "Version, and every codec stage with its parameters and ranges"), Info);

  // ---- kv synth ----
  auto* kv = app.add_subcommand("kv", "KV cache files (.kvf): synthesize, capture from a model");
  kv->require_subcommand(1);
  {
    auto* c = kv->add_subcommand("synth", "Synthesize a realistic KV block (see docs/SYNTHETIC_KV.md)");
    auto shape = std::make_shared<std::string>("llama3-8b");
    auto tokens = std::make_shared<uint32_t>(1024);
    auto seed = std::make_shared<uint64_t>(1);
    auto dtype = std::make_shared<std::string>("f16");
    auto out = std::make_shared<std::string>();
    c->add_option("--shape", *shape, "llama3-8b | stories260k | babyllama105")->capture_default_str();
    c->add_option("--tokens", *tokens, "number of tokens")->capture_default_str()->check(InRange(1, 1 << 24));
    c->add_option("--seed", *seed, "random seed")->capture_default_str();
    c->add_option("--dtype", *dtype, "f16 | bf16 | f32 | e4m3 | e5m2")->capture_default_str();
    auto fp8_scale = std::make_shared<std::string>("none");
    c->add_option("--fp8-scale", *fp8_scale,
                  "with e4m3/e5m2: none | tensor (one scale per layer and K/V, vLLM's k_scale/v_scale) | head")
        ->capture_default_str();
    c->add_option("-o,--output", *out, "output .kvf file")->required()->check(OutputPath());
    SetAction(c, [=]() -> Status {
      KV_ASSIGN_OR_RETURN(KvShape s, ShapePreset(*shape, *tokens));
      SynthOptions o;
      o.seed = *seed;
      KV_ASSIGN_OR_RETURN(o.dtype, ParseDType(*dtype));
      KV_ASSIGN_OR_RETURN(o.fp8_scale, ParseFp8Granularity(*fp8_scale));
      o.pool = Pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
      KV_ASSIGN_OR_RETURN(KvBlock b, SynthesizeKv(s, o));
      KV_RETURN_IF_ERROR(WriteKvFile(*out, b));
      std::printf("wrote %s: %s %s%s, %.1f MiB\n", out->c_str(), s.ToString().c_str(), DTypeName(b.dtype()),
                  b.fp8_scales().empty() ? "" : (std::string(" scaled per ") + Fp8GranularityName(o.fp8_scale)).c_str(),
                  b.bytes() / 1048576.0);
      return Status::Ok();
    });
  }

  auto* codec = app.add_subcommand("codec", "Encode, decode, compare and benchmark codec strategies");
  codec->require_subcommand(1);
  {
    auto* c = codec->add_subcommand("encode", "Encode a KV file with a strategy into a frame file");
    auto spec = std::make_shared<std::string>();
    auto in = std::make_shared<std::string>();
    auto out = std::make_shared<std::string>();
    auto threads = std::make_shared<int>(1);
    c->add_option("-s,--strategy", *spec, "strategy spec, e.g. 'quant(kbits=2,vbits=2)|zstd(level=3)'")->required();
    c->add_option("-i,--input", *in, "input frame (.kvf)")->required();
    c->add_option("-o,--output", *out, "output frame")->required()->check(OutputPath());
    c->add_option("--threads", *threads, "worker threads")->capture_default_str()->check(InRange(1, 256));
    SetAction(c, [=]() -> Status {
      KV_ASSIGN_OR_RETURN(Pipeline p, Pipeline::Create(*spec, Codec()));
      KV_ASSIGN_OR_RETURN(KvBlock b, ReadAnyFrame(*in));
      ByteBuffer frame;
      CodecOptions o;
      o.pool = Pool(*threads);
      const double t0 = NowSeconds();
      KV_RETURN_IF_ERROR(p.Encode(b, &frame, o));
      const double dt = NowSeconds() - t0;
      KV_RETURN_IF_ERROR(WriteFileAtomic(*out, frame));
      std::printf("%s: %s, %zu -> %zu bytes (%.2fx), encode %.2f GB/s\n", out->c_str(), p.spec().c_str(), b.bytes(),
                  frame.size(), double(b.bytes()) / frame.size(), b.bytes() / 1e9 / dt);
      return Status::Ok();
    });
  }
  {
    auto* c = codec->add_subcommand("decode", "Decode any frame back to a plain KV file (strategy 'none')");
    auto in = std::make_shared<std::string>();
    auto out = std::make_shared<std::string>();
    c->add_option("-i,--input", *in, "input frame")->required();
    c->add_option("-o,--output", *out, "output .kvf")->required()->check(OutputPath());
    SetAction(c, [=]() -> Status {
      KV_ASSIGN_OR_RETURN(KvBlock b, ReadAnyFrame(*in));
      KV_RETURN_IF_ERROR(WriteKvFile(*out, b));
      std::printf("%s: %s %s\n", out->c_str(), b.shape().ToString().c_str(), DTypeName(b.dtype()));
      return Status::Ok();
    });
  }
  {
    auto* c = codec->add_subcommand("compare", "Error of b against reference a, for K and V separately");
    auto a = std::make_shared<std::string>();
    auto b = std::make_shared<std::string>();
    auto as_json = std::make_shared<bool>(false);
    c->add_option("reference", *a, "reference frame")->required();
    c->add_option("test", *b, "frame to compare")->required();
    c->add_flag("--json", *as_json, "machine-readable output");
    SetAction(c, [=]() -> Status {
      KV_ASSIGN_OR_RETURN(KvBlock ra, ReadAnyFrame(*a));
      KV_ASSIGN_OR_RETURN(KvBlock rb, ReadAnyFrame(*b));
      KV_ASSIGN_OR_RETURN(KvCompareResult r, CompareKv(ra, rb));
      if (*as_json) {
        std::printf("%s\n", json{{"k", StatsJson(r.k)}, {"v", StatsJson(r.v)}}.dump(2).c_str());
      } else {
        std::printf("     %12s %12s %10s %10s\n", "max_abs", "mean_abs", "snr_db", "cosine");
        std::printf("K    %12.6g %12.6g %10.2f %10.6f\n", r.k.max_abs, r.k.mean_abs, r.k.snr_db, r.k.cosine);
        std::printf("V    %12.6g %12.6g %10.2f %10.6f\n", r.v.max_abs, r.v.mean_abs, r.v.snr_db, r.v.cosine);
      }
      return Status::Ok();
    });
  }
  {
    auto* c = codec->add_subcommand("bench",
                                    "Throughput, ratio and SNR of strategies on a synthetic llama3-8b block (fp16 unless --dtype), "
                                    "against memcpy and zstd measured in the same run");
    auto specs = std::make_shared<std::vector<std::string>>();
    auto tokens = std::make_shared<uint32_t>(1024);
    auto threads = std::make_shared<std::vector<int>>(std::vector<int>{1});
    auto runs = std::make_shared<int>(7);
    auto as_json = std::make_shared<bool>(false);
    auto per_layer = std::make_shared<bool>(true);
    auto entropy_payload = std::make_shared<std::string>("quant(kbits=4,vbits=4)");
    auto dtype_name = std::make_shared<std::string>("f16");
    auto paged = std::make_shared<bool>(false);
    auto block_size = std::make_shared<uint32_t>(16);
    c->add_option("-s,--strategy", *specs, "strategy to measure (repeatable); default: 8/4/2-bit quant, +/- zstd");
    c->add_option("--entropy-payload", *entropy_payload,
                  "quantised payload on which zstd(level=3) and rans are compared")->capture_default_str();
    c->add_option("--tokens", *tokens, "tokens in the block")->capture_default_str()->check(InRange(1, 65536));
    c->add_option("--dtype", *dtype_name, "storage type of the block (f16, bf16, f32); ratios are over its bytes")
        ->capture_default_str();
    c->add_option("--threads", *threads,
                  "codec threads; a list (1,2) sweeps them and reports each speed's scaling over the first")
        ->delimiter(',')->capture_default_str()->check(InRange(1, 256));
    c->add_option("--runs", *runs, "runs per measurement (median)")->capture_default_str()->check(InRange(1, 1000));
    c->add_flag("--json", *as_json, "machine-readable output");
    c->add_flag("--paged", *paged,
                "instead: each strategy (default 4-bit quant and fp8) from and into a paged token-major cache "
                "(vLLM's layout, shuffled pages) against the dense layout, with the memory the paged runs add");
    c->add_option("--block-size", *block_size, "with --paged: tokens per page")->capture_default_str()->check(InRange(1, 65536));
    c->add_flag("--per-layer,!--no-per-layer", *per_layer,
                "also measure the serving path: one frame per layer, decoded through a LayerAssembler")
        ->capture_default_str();
    SetAction(c, [=]() -> Status {
      if (*paged) return PagedBench(*specs, *tokens, *dtype_name, *runs, *block_size, *as_json);
      const std::vector<std::string>& list = specs->empty() ? kDefaultBenchStrategies : *specs;
      for (const auto& s : list) KV_RETURN_IF_ERROR(CanonicalStrategy(s).status());
      KV_RETURN_IF_ERROR(CanonicalStrategy(*entropy_payload + "|rans").status());
      KV_ASSIGN_OR_RETURN(DType dtype, ParseDType(*dtype_name));
      KV_ASSIGN_OR_RETURN(KvBlock block, BenchBlock(*tokens, Pool(static_cast<int>(std::max(1u, std::thread::hardware_concurrency()))),
                                                    dtype));
      // One sweep point per thread count: zstd, every strategy, then the entropy pair.
      struct Point {
        int threads = 1;
        ZstdMeasurement z;
        std::vector<CodecMeasurement> rows;
        CodecMeasurement ez, er;
      };
      const size_t per_point = list.size() + 3;
      Progress progress("codec bench", 1 + threads->size() * per_point);
      const double memcpy_gbps = MeasureMemcpyGbps(block.bytes(), *runs);
      size_t done = 1;
      progress.Update(done, "memcpy");
      std::vector<Point> points;
      for (int t : *threads) {
        Point pt;
        pt.threads = t;
        BenchOptions bo;
        bo.runs = *runs;
        bo.threads = t;
        bo.pool = Pool(t);
        bo.env = Codec();
        bo.per_layer = *per_layer;
        const std::string at = " (" + std::to_string(t) + " thread" + (t == 1 ? ")" : "s)");
        BenchOptions zo = bo;
        zo.runs = std::min(3, *runs);
        pt.z = MeasureZstd(block.data(), block.bytes(), 3, zo);
        progress.Update(++done, "zstd" + at);
        for (const auto& spec : list) {
          KV_ASSIGN_OR_RETURN(CodecMeasurement m, MeasureCodec(block, spec, bo));
          pt.rows.push_back(m);
          progress.Update(++done, m.spec + at);
        }
        bo.per_layer = false;  // the entropy pair compares coders on one payload
        KV_ASSIGN_OR_RETURN(pt.ez, MeasureCodec(block, *entropy_payload + "|zstd(level=3)", bo));
        progress.Update(++done, "entropy: zstd" + at);
        KV_ASSIGN_OR_RETURN(pt.er, MeasureCodec(block, *entropy_payload + "|rans", bo));
        progress.Update(++done, "entropy: rans" + at);
        points.push_back(std::move(pt));
      }
      progress.Done();
      const std::string payload_spec = CanonicalStrategy(*entropy_payload).value();
      const Point& base = points.front();
      auto zstd_json = [](const ZstdMeasurement& z) {
        return json{{"level", 3}, {"encode_gbps", z.encode_gbps}, {"decode_gbps", z.decode_gbps}, {"ratio", z.ratio}};
      };
      auto strategy_json = [&](const CodecMeasurement& m) {
        json j = {{"spec", m.spec},
                  {"encode_gbps", m.encode_gbps},
                  {"decode_gbps", m.decode_gbps},
                  {"ratio", m.ratio},
                  {"snr_db_k", m.snr_db_k},
                  {"snr_db_v", m.snr_db_v},
                  {"encode_vs_memcpy", m.encode_gbps / memcpy_gbps},
                  {"decode_vs_memcpy", m.decode_gbps / memcpy_gbps}};
        if (m.layer_frame_bytes > 0) {
          j["per_layer"] = {{"encode_gbps", m.layer_encode_gbps},
                            {"decode_gbps", m.layer_decode_gbps},
                            {"ratio", double(block.bytes()) / double(m.layer_frame_bytes)},
                            {"frame_bytes", m.layer_frame_bytes},
                            {"encode_vs_block", m.layer_encode_gbps / m.encode_gbps},
                            {"decode_vs_block", m.layer_decode_gbps / m.decode_gbps}};
        }
        return j;
      };
      auto entropy_json = [&](const Point& p) {
        return json{{"payload", payload_spec},
                    {"zstd_bytes", p.ez.frame_bytes},
                    {"rans_bytes", p.er.frame_bytes},
                    {"rans_vs_zstd", double(p.er.frame_bytes) / double(p.ez.frame_bytes)},
                    {"zstd_encode_gbps", p.ez.encode_gbps},
                    {"rans_encode_gbps", p.er.encode_gbps},
                    {"zstd_decode_gbps", p.ez.decode_gbps},
                    {"rans_decode_gbps", p.er.decode_gbps}};
      };
      if (*as_json) {
        // The top level is the first thread count (as without a sweep); "sweep" holds every
        // point, with each speed's scaling over the first point's.
        json j;
        j["block"] = {{"shape", block.shape().ToString()}, {"dtype", DTypeName(dtype)}, {"bytes", block.bytes()}};
        j["threads"] = base.threads;
        j["runs"] = *runs;
        j["memcpy_gbps"] = memcpy_gbps;
        j["simd"] = cpu::TierName(cpu::Active());
        j["zstd"] = zstd_json(base.z);
        j["strategies"] = json::array();
        for (const auto& m : base.rows) j["strategies"].push_back(strategy_json(m));
        j["entropy"] = entropy_json(base);
        j["sweep"] = json::array();
        for (const Point& p : points) {
          json s = {{"threads", p.threads}, {"zstd", zstd_json(p.z)}, {"entropy", entropy_json(p)}};
          s["strategies"] = json::array();
          for (size_t i = 0; i < p.rows.size(); ++i) {
            json m = strategy_json(p.rows[i]);
            m["encode_scaling"] = p.rows[i].encode_gbps / base.rows[i].encode_gbps;
            m["decode_scaling"] = p.rows[i].decode_gbps / base.rows[i].decode_gbps;
            s["strategies"].push_back(std::move(m));
          }
          s["entropy"]["rans_encode_scaling"] = p.er.encode_gbps / base.er.encode_gbps;
          s["entropy"]["rans_decode_scaling"] = p.er.decode_gbps / base.er.decode_gbps;
          j["sweep"].push_back(std::move(s));
        }
        std::printf("%s\n", j.dump(2).c_str());
        return Status::Ok();
      }
      std::printf("block: llama3-8b %s %s, %.1f MiB; median of %d runs\n", block.shape().ToString().c_str(),
                  DTypeName(dtype), block.bytes() / 1048576.0, *runs);
      std::printf("memcpy           %7.2f GB/s (one thread); %s kernels\n", memcpy_gbps, cpu::TierName(cpu::Active()));
      for (const Point& p : points) {
        std::printf("\n== %d thread(s) ==\n", p.threads);
        std::printf("zstd(level=3)    encode %6.2f GB/s  decode %6.2f GB/s  ratio %5.2fx\n\n", p.z.encode_gbps,
                    p.z.decode_gbps, p.z.ratio);
        std::printf("%-44s %8s %8s %7s %7s %7s %7s %7s\n", "strategy", "enc GB/s", "dec GB/s", "enc/mc", "dec/mc",
                    "ratio", "SNR K", "SNR V");
        for (const auto& m : p.rows) {
          std::printf("%-44s %8.2f %8.2f %7.2f %7.2f %6.2fx %7.1f %7.1f\n", m.spec.c_str(), m.encode_gbps,
                      m.decode_gbps, m.encode_gbps / memcpy_gbps, m.decode_gbps / memcpy_gbps, m.ratio, m.snr_db_k,
                      m.snr_db_v);
        }
        if (*per_layer) {
          std::printf("\nper-layer frames (the serving path: a frame per layer, decoded through a LayerAssembler):\n");
          std::printf("%-44s %8s %8s %9s %9s %7s\n", "strategy", "enc GB/s", "dec GB/s", "enc/block", "dec/block",
                      "ratio");
          for (const auto& m : p.rows) {
            if (m.layer_frame_bytes == 0) {
              std::printf("%-44s (one frame per request on the serving path)\n", m.spec.c_str());
              continue;
            }
            std::printf("%-44s %8.2f %8.2f %8.2fx %8.2fx %6.2fx\n", m.spec.c_str(), m.layer_encode_gbps,
                        m.layer_decode_gbps, m.layer_encode_gbps / m.encode_gbps, m.layer_decode_gbps / m.decode_gbps,
                        double(block.bytes()) / double(m.layer_frame_bytes));
          }
        }
        std::printf("\nentropy coding of the same payload, %s:\n", payload_spec.c_str());
        std::printf("  zstd(level=3) %10llu bytes  enc %6.2f GB/s  dec %6.2f GB/s\n",
                    static_cast<unsigned long long>(p.ez.frame_bytes), p.ez.encode_gbps, p.ez.decode_gbps);
        std::printf("  rans          %10llu bytes  enc %6.2f GB/s  dec %6.2f GB/s  (%.1f%% of zstd's size)\n",
                    static_cast<unsigned long long>(p.er.frame_bytes), p.er.encode_gbps, p.er.decode_gbps,
                    100.0 * double(p.er.frame_bytes) / double(p.ez.frame_bytes));
      }
      if (points.size() > 1) {
        std::printf("\nscaling over %d thread(s), encode / decode:\n", base.threads);
        std::printf("%-44s", "strategy");
        for (size_t k = 1; k < points.size(); ++k) std::printf("  %5d thr enc/dec", points[k].threads);
        std::printf("\n");
        auto line = [&](const std::string& name, auto get) {
          std::printf("%-44s", name.c_str());
          const CodecMeasurement& b = get(base);
          for (size_t k = 1; k < points.size(); ++k) {
            const CodecMeasurement& m = get(points[k]);
            std::printf("      %5.2fx/%5.2fx", m.encode_gbps / b.encode_gbps, m.decode_gbps / b.decode_gbps);
          }
          std::printf("\n");
        };
        for (size_t i = 0; i < base.rows.size(); ++i)
          line(base.rows[i].spec, [i](const Point& p) -> const CodecMeasurement& { return p.rows[i]; });
        line(payload_spec + "|rans", [](const Point& p) -> const CodecMeasurement& { return p.er; });
      }
      return Status::Ok();
    });
  }
}

}  // namespace kvserve::cli
