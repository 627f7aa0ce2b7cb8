// http_endpoint.h: serves GET /metrics (Prometheus text format 0.0.4) and GET /healthz.
//
// Why not prometheus-cpp's Exposer: it runs on civetweb, whose distribution builds use 100 KB
// thread stacks, and in a process that loads the CUDA build of libtorch pthread_create fails
// for such stacks (static TLS of the CUDA libraries), so the Exposer dies at start (docs/architecture.md).
// We keep prometheus-cpp's registry and TextSerializer and serve them with cpp-httplib, whose
// threads have the default stack size.
//
// The constructor binds the socket itself, so "address already in use" is a startup error
// (StartupError naming the address), never a silent missing endpoint. The destructor stops
// the server and joins its thread. Scrapes run on the server's threads; collectables must
// be thread-safe (prometheus-cpp's are).
#pragma once

#include <prometheus/collectable.h>
#include <prometheus/registry.h>

#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "common/health.h"

namespace httplib {
class Server;
}

namespace dflash::daemon {

class StartupError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

class HttpEndpoint {
 public:
  // `listen` is "host:port" (port 0: any free port, see port()). The collectables are
  // serialised in order on each scrape.
  HttpEndpoint(const std::string& listen, std::vector<std::shared_ptr<prometheus::Collectable>> collectables,
               std::shared_ptr<const Health> health);
  ~HttpEndpoint();
  HttpEndpoint(const HttpEndpoint&) = delete;
  HttpEndpoint& operator=(const HttpEndpoint&) = delete;

  int port() const { return port_; }
  const std::string& host() const { return host_; }

  // The exposition text of the collectables (what GET /metrics returns).
  static std::string render(const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables);

 private:
  std::unique_ptr<httplib::Server> server_;
  std::thread thread_;
  std::string host_;
  int port_ = 0;
};

}  // namespace dflash::daemon
