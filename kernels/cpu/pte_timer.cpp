// pte_timer: times .pte files in ExecuTorch's C++ runtime (libexecutorch + the XNNPACK delegate and the
// optimized / quantized kernels the executorch wheel ships), as a deployer's C++ process calls them: no Python.
// Built on first use by intqat/deploy/pte_cpp.py against the installed wheel's headers and libraries.
//
// One XNNPACK thread (the pool is reset before any program is loaded); each round calls every file in turn (the
// order rotated each round), `burst` calls in a row each: the first just after another file's ("after_other"),
// the rest after the file itself ("back_to_back": how a deployer's process calls its one model). CPU time of
// this process per call (CLOCK_PROCESS_CPUTIME_ID, as Python's process_time).
// Spec file, one item a line:
//   repeats <n> | warmup <n> | burst <n> | pte <name> <path> | input <batch> <float32|int64|int32> <d0,d1,...> <raw>
// (inputs of one batch in forward()'s order). Prints
//   {"<batch>": {"back_to_back": {"<name>": median ms, ...}, "after_other": {...}}, ...} on stdout.
#include <executorch/extension/module/module.h>
#include <executorch/extension/tensor/tensor.h>

#include <algorithm>
#include <cstdio>
#include <ctime>
#include <fstream>
#include <iterator>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

// The wheel ships libexecutorch_threadpool but not its header: the two entry points used, as declared there
// (extension/threadpool/threadpool.h).
namespace executorch::extension::threadpool {
class ThreadPool {
 public:
  bool _unsafe_reset_threadpool(uint32_t num_threads);
};
ThreadPool* get_threadpool();
}  // namespace executorch::extension::threadpool

using executorch::aten::ScalarType;
using executorch::extension::Module;
using executorch::extension::TensorPtr;
using executorch::runtime::EValue;

static double cpu_ms() {
  timespec t;
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec * 1e-6;
}

// {"<name>": median, ...} of each file's times
static std::string medians(std::map<std::string, std::vector<double>> times) {
  std::string json = "{";
  for (auto& [name, v] : times) {
    std::sort(v.begin(), v.end());
    size_t n = v.size();
    double median = n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.9g", median);
    json += (json.size() > 1 ? ", \"" : "\"") + name + "\": " + buf;
  }
  return json + "}";
}

static int fail(const std::string& what) {
  std::fprintf(stderr, "pte_timer: %s\n", what.c_str());
  return 1;
}

int main(int argc, char** argv) {
  if (argc != 2) return fail("usage: pte_timer <spec file>");
  executorch::extension::threadpool::get_threadpool()->_unsafe_reset_threadpool(1);
  std::ifstream spec(argv[1]);
  if (!spec) return fail(std::string("cannot read ") + argv[1]);
  int repeats = 30, warmup = 3, burst = 4;
  std::vector<std::pair<std::string, std::unique_ptr<Module>>> ptes;
  std::map<int, std::vector<std::vector<char>>> raw;  // batch -> its inputs' bytes (the tensors point into them)
  std::map<int, std::vector<TensorPtr>> tensors;
  std::string line;
  while (std::getline(spec, line)) {
    std::istringstream in(line);
    std::string kind;
    in >> kind;
    if (kind == "repeats") {
      in >> repeats;
    } else if (kind == "warmup") {
      in >> warmup;
    } else if (kind == "burst") {
      in >> burst;
      if (burst < 1) return fail("burst must be >= 1");
    } else if (kind == "pte") {
      std::string name, path;
      in >> name >> path;
      auto m = std::make_unique<Module>(path, Module::LoadMode::File);
      if (m->load_forward() != executorch::runtime::Error::Ok) return fail("cannot load the forward method of " + path);
      ptes.emplace_back(name, std::move(m));
    } else if (kind == "input") {
      int batch;
      std::string dtype, shape, path;
      in >> batch >> dtype >> shape >> path;
      std::vector<executorch::aten::SizesType> sizes;
      std::istringstream dims(shape);
      for (std::string d; std::getline(dims, d, ',');) sizes.push_back(std::stoi(d));
      ScalarType st = dtype == "float32" ? ScalarType::Float
                    : dtype == "int64"   ? ScalarType::Long
                    : dtype == "int32"   ? ScalarType::Int
                                         : ScalarType::Undefined;
      if (st == ScalarType::Undefined) return fail("input dtype " + dtype + " not supported");
      std::ifstream f(path, std::ios::binary);
      raw[batch].emplace_back(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
      tensors[batch].push_back(executorch::extension::from_blob(raw[batch].back().data(), sizes, st));
    } else if (!kind.empty()) {
      return fail("unknown spec line: " + line);
    }
  }
  std::string json = "{";
  for (auto& [batch, ts] : tensors) {
    std::vector<EValue> inputs(ts.begin(), ts.end());
    std::map<std::string, std::vector<double>> back_to_back, after_other;
    const size_t n_files = ptes.size();
    for (int r = -warmup; r < repeats; ++r) {
      for (size_t j = 0; j < n_files; ++j) {
        auto& [name, m] = ptes[(j + (r < 0 ? 0 : r)) % n_files];  // (the order rotates each round)
        for (int i = 0; i < (r < 0 ? 1 : burst); ++i) {
          double t0 = cpu_ms();
          auto out = m->forward(inputs);
          double dt = cpu_ms() - t0;
          if (!out.ok()) return fail(name + " failed at batch " + std::to_string(batch));
          if (r >= 0) (i ? back_to_back : after_other)[name].push_back(dt);
        }
      }
    }
    json += (json.size() > 1 ? ", \"" : "\"") + std::to_string(batch) + "\": {\"back_to_back\": " +
            medians(back_to_back.empty() ? after_other : back_to_back) + ", \"after_other\": " +
            medians(after_other) + "}";
  }
  std::printf("%s}\n", json.c_str());
  return 0;
}
