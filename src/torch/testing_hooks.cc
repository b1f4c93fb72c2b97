// manager_modules._testing: hooks for tests and benchmarks (the codecs' bindings, the decode block limit,
// the once-only log state, the simulator's fault and memory injection). Not part of the drop-in's
// namespace, which is AI-Toolkit's; nothing here is needed to train.
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <string>
#include <vector>

#include "bindings.h"
#include "cuda_allocation_retry.h"
#include "device_registry.h"
#include "host_share.h"
#include "layerstream/check.h"
#include "layerstream/log.h"
#include "layerstream/sim_backend.h"
#include "ostris_fast.h"
#include "packed_weight_glue.h"
#include "streamed_layer.h"

namespace py = pybind11;

namespace layerstream::torchglue {

namespace {

// The simulator behind a device state, for the test hooks (`what`: the hook's name, for the message).
SimBackend& simulator_of(DeviceStateHandle& h, const char* what) {
  auto* sim = dynamic_cast<SimBackend*>(&h.state->backend());
  LS_CHECK_ARG(sim != nullptr, what, ": this device state does not run on the simulator (LAYERSTREAM_BACKEND=sim)");
  return *sim;
}

at::ScalarType float_dtype_of(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "float16") return at::kHalf;
  if (name == "bfloat16") return at::kBFloat16;
  throw py::value_error("dtype must be float32, float16 or bfloat16, not '" + name + "'");
}

void bind_codecs(py::module_& t) {
  t.def(
      "dequantize",
      [](const at::Tensor& codes, const at::Tensor& scale, const std::string& out, const std::string& math,
         bool use_core) {
        return dequantize_codes(codes, scale, float_dtype_of(math), float_dtype_of(out), use_core);
      },
      py::arg("codes"), py::arg("scale"), py::arg("out") = "bfloat16", py::arg("math") = "float32",
      py::arg("use_core") = true,
      "Codes (int8/float8) times a per-row (or single) scale, rounded to `math` then to `out`: the fused "
      "CUDA kernel for CUDA tensors, its host reference for CPU ones (use_core=False: torch operations).");
  t.def(
      "lossless_pack",
      [](const at::Tensor& weight) {
        LS_CHECK_ARG(weight.scalar_type() == at::kBFloat16 && weight.numel() > 0,
                     "lossless_pack takes a non-empty bfloat16 tensor, not ", weight.scalar_type(), " of shape ",
                     weight.sizes());
        auto [codes, spec] = *lossless_pack(weight, /*only_if_smaller=*/false);
        const std::vector<int> table(spec.exponent.begin(), spec.exponent.end());
        return py::make_tuple(codes, py::make_tuple(spec.count, spec.exceptions, table));
      },
      py::arg("weight"), "Packs a bfloat16 tensor losslessly (layerstream/lossless.h) on the host: (uint8 bytes, spec).");
  t.def("lossless_unpack", &lossless_unpack_from_python, py::arg("codes"), py::arg("spec"), py::arg("shape"),
        py::arg("max_blocks") = 0u,
        "The bfloat16 tensor of `shape` rebuilt from lossless_pack's bytes (on their device: the CUDA kernels "
        "on torch's current stream, at most `max_blocks` thread blocks, 0 for no limit; or the host reference). "
        "The bytes are trusted (the CUDA path does not check the exception list's indices).");
  t.def("lossless_threads", &lossless_threads,
        "How many threads the host's lossless encoder runs on (0 was set: one per core).");
  t.def("set_lossless_threads", &lossless_set_threads, py::arg("threads"),
        "Sets how many threads the host's lossless encoder runs on (0: one per core, the default); its output "
        "is the same for any number. For benchmarks and tests.");
  t.def(
      "lossless_pack_times",
      [] {
        const LosslessPackTimes t = lossless_pack_times();
        py::dict d;
        d["weights"] = t.weights;
        d["bytes_in"] = t.bytes_in;
        d["copy_s"] = t.copy_s;
        d["table_s"] = t.table_s;
        d["block_s"] = t.block_s;
        return d;
      },
      "Where the time of packing weights losslessly went, summed over the process: the weights packed, their "
      "bytes, and seconds copying them to ordinary host memory, building their tables, and allocating and "
      "encoding their arena blocks.");
  t.def("nvfp4_fake_quantize", &nvfp4_fake_quantize, py::arg("x"),
        "convrot4's straight-through activation quantization (ostris_decode.h) of a [rows, cols] tensor on its "
        "device: (the float32 tensor scale, delta = x_dq - x).");
  t.def(
      "nvfp4_decode",
      [](const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& pts, std::int64_t rows,
         std::int64_t cols, const std::string& out, bool plus_zero) {
        return nvfp4_decode(packed, scales, pts, rows, cols, float_dtype_of(out), plus_zero);
      },
      py::arg("packed"), py::arg("scales"), py::arg("pts"), py::arg("rows"), py::arg("cols"),
      py::arg("out") = "bfloat16", py::arg("plus_zero") = false,
      "An nvfp4 weight decoded on the tensors' device: uint8 codes [rows, cols/2], e4m3 scale bytes [rows, "
      "cols/16], the float32 tensor scale as 4 bytes; code 8 as +0 with plus_zero (else -0).");
  t.def(
      "int_rows_decode",
      [](const at::Tensor& packed, const std::optional<at::Tensor>& ratio, const at::Tensor& scales, std::int64_t rows,
         std::int64_t cols, const std::string& codes, int bits, const std::string& out) {
        return int_rows_decode(packed, ratio, scales, rows, cols, codes, bits, float_dtype_of(out));
      },
      py::arg("packed"), py::arg("ratio"), py::arg("scales"), py::arg("rows"), py::arg("cols"), py::arg("codes"),
      py::arg("bits") = 8, py::arg("out") = "bfloat16",
      "A ConvRot int weight decoded on the tensors' device (ostris_decode.h): codes 'int8', 'bitfield' or "
      "'ternary', float32 row scales, float32 group ratios or None.");
  t.def("decode_blocks", &decode_blocks,
        "The most thread blocks a lossless decode on the derive stream uses (LAYERSTREAM_DECODE_BLOCKS; 0: no "
        "limit).");
  t.def("set_decode_blocks", &set_decode_blocks, py::arg("blocks"),
        "Sets the most thread blocks for the lossless decodes enqueued from now on (0: no limit).");
}

void bind_simulator(py::module_& t) {
  t.def("sim_fail_next_copies",
        [](DeviceStateHandle& h, int count) { simulator_of(h, "sim_fail_next_copies").fail_next_h2d_copies(count); },
        py::arg("state"), py::arg("count"),
        "Simulator only: the next `count` host-to-device copies of `state` fail to be issued (as a failed CUDA "
        "call would).");
  t.def("sim_device_alloc",
        [](DeviceStateHandle& h, std::size_t bytes) {
          void* p = simulator_of(h, "sim_device_alloc").device_alloc(bytes);
          LS_CHECK(p != nullptr, "out of memory on the simulated device: ", bytes, " bytes did not fit");
          return reinterpret_cast<std::uintptr_t>(p);
        },
        py::arg("state"), py::arg("bytes"),
        "Simulator only: takes `bytes` of `state`'s simulated device as another allocation of the process "
        "would (memory pressure gives resident layers back first); returns a handle for sim_device_free.");
  t.def("sim_device_free",
        [](DeviceStateHandle& h, std::uintptr_t handle) {
          simulator_of(h, "sim_device_free").device_free(reinterpret_cast<void*>(handle));
        },
        py::arg("state"), py::arg("handle"), "Simulator only: frees what sim_device_alloc took.");
  t.def("sim_device_free_bytes",
        [](DeviceStateHandle& h) { return simulator_of(h, "sim_device_free_bytes").device_memory_info().first; },
        py::arg("state"), "Simulator only: the bytes of `state`'s simulated device not allocated now.");
}

}  // namespace

void bind_testing(py::module_& m) {
  py::module_ t = m.def_submodule("_testing", "Hooks for layerstream's tests and benchmarks (not AI-Toolkit's surface).");
  bind_codecs(t);
  bind_simulator(t);
  t.def("parent_process_id", &parent_process_id,
        "The parent process id the share handshake names torchrun's ranks by (os.getppid() in Python).");
  t.def("allocation_retries", &allocation_retries,
        "Tensor allocations on a GPU tried again after resident layers were given back (cuda_allocation_retry.h).");
  t.def("allocation_retry_installed", &allocation_retry_installed,
        "Whether torch's CUDA allocator is wrapped by the allocation retry in this process.");
  t.def("reset_log_once", &reset_log_once,
        "Forgets which once-only messages this module logged (its own log state, not _native's).");
}

}  // namespace layerstream::torchglue
