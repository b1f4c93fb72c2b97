// The share handshake: how the ranks of a host agree on the name of their shared segments
// (HostShare's resolver, installed by the Python module). torchrun's environment names it without a
// collective call; other launchers agree on a fresh name through torch.distributed.
#include <torch/csrc/utils/pybind.h>

#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#ifdef _WIN32
#define WIN32_LEAN_AND_MEAN
#define NOMINMAX
#include <windows.h>
#include <tlhelp32.h>
#else
#include <unistd.h>
#endif

#include "host_share.h"
#include "layerstream/check.h"
#include "layerstream/log.h"
#include "layerstream/settings.h"

namespace py = pybind11;

namespace layerstream::torchglue {

long parent_process_id() {
#ifdef _WIN32
  // Windows keeps no parent link in the process itself: the process table's entry for this process has it.
  const DWORD self = GetCurrentProcessId();
  HANDLE snapshot = CreateToolhelp32Snapshot(TH32CS_SNAPPROCESS, 0);
  if (snapshot == INVALID_HANDLE_VALUE) return 0;
  long parent = 0;
  PROCESSENTRY32W entry{};
  entry.dwSize = sizeof entry;
  for (BOOL more = Process32FirstW(snapshot, &entry); more; more = Process32NextW(snapshot, &entry)) {
    if (entry.th32ProcessID == self) {
      parent = static_cast<long>(entry.th32ParentProcessID);
      break;
    }
  }
  CloseHandle(snapshot);
  return parent;
#else
  return static_cast<long>(::getppid());
#endif
}

std::optional<ShareConfig> resolve_share() {
  const std::shared_ptr<const Settings> settings = Settings::current();
  if (settings->share_host == ShareHost::kOff) return std::nullopt;
  const char* world = settings->local_world_size ? settings->local_world_size->c_str() : nullptr;
  const char* rank = settings->local_rank ? settings->local_rank->c_str() : nullptr;
  if (world == nullptr || rank == nullptr || std::atoi(world) <= 1) {
    if (settings->share_host == ShareHost::kOn) {
      log_once("share-no-ranks", LogLevel::kWarning,
               "LAYERSTREAM_SHARE_HOST is on but LOCAL_RANK / LOCAL_WORLD_SIZE (set by torchrun and accelerate) "
               "do not name several ranks on this host: nothing to share");
    }
    return std::nullopt;
  }
  ShareConfig config;
  config.local_world = std::atoi(world);
  config.local_rank = std::atoi(rank);
  LS_CHECK_ARG(config.local_rank >= 0 && config.local_rank < config.local_world, "LOCAL_RANK=", rank,
               " is not below LOCAL_WORLD_SIZE=", world);
  config.timeout_s = settings->share_timeout_s;
  const char* run_id = settings->torchelastic_run_id ? settings->torchelastic_run_id->c_str() : nullptr;
  if (settings->share_token) {
    config.token = *settings->share_token;
  } else if (run_id != nullptr) {
    // torchrun (and accelerate, which uses it) starts the local ranks from one agent process, with the
    // same run id and master port: the name follows from those without any collective call, so a rank
    // that attaches alone (or late) never blocks the others.
    const char* port = settings->master_port ? settings->master_port->c_str() : nullptr;
    const std::string key = std::string(run_id) + "/" + (port ? port : "") + "/" + std::to_string(parent_process_id());
    char hex[17];
    std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(std::hash<std::string>{}(key)));
    config.token = hex;
  } else {
    // Other launchers: the ranks agree on a fresh name through torch.distributed (global rank 0 draws it;
    // a collective call, so every rank must attach): segments of another job never collide with this one's.
    py::gil_scoped_acquire gil;
    py::module_ dist = py::module_::import("torch.distributed");
    if (!dist.attr("is_available")().cast<bool>() || !dist.attr("is_initialized")().cast<bool>()) {
      log_once("share-no-dist", LogLevel::kWarning,
               "LOCAL_WORLD_SIZE > 1 but torch.distributed is not initialized (and LAYERSTREAM_SHARE_TOKEN is "
               "unset): each rank keeps its own host copy of the weights; initialize the process group before "
               "attaching to share one");
      return std::nullopt;
    }
    py::list box;
    if (dist.attr("get_rank")().cast<int>() == 0) {
      box.append(py::module_::import("os").attr("urandom")(8).attr("hex")());
    } else {
      box.append(py::none());
    }
    dist.attr("broadcast_object_list")(box, py::arg("src") = 0);
    config.token = box[0].cast<std::string>();
  }
  return config;
}

}  // namespace layerstream::torchglue
