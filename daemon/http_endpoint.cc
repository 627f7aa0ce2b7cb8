#include "daemon/http_endpoint.h"

#include <httplib.h>
#include <prometheus/text_serializer.h>

#include <chrono>
#include <cstring>

#include "common/log.h"

namespace dflash::daemon {

std::string HttpEndpoint::render(const std::vector<std::shared_ptr<prometheus::Collectable>>& collectables) {
  std::vector<prometheus::MetricFamily> families;
  for (const auto& c : collectables) {
    auto collected = c->Collect();
    families.insert(families.end(), std::make_move_iterator(collected.begin()),
                    std::make_move_iterator(collected.end()));
  }
  return prometheus::TextSerializer().Serialize(families);
}

HttpEndpoint::HttpEndpoint(const std::string& listen,
                           std::vector<std::shared_ptr<prometheus::Collectable>> collectables,
                           std::shared_ptr<const Health> health)
    : server_(std::make_unique<httplib::Server>()) {
  // Port 0 is allowed here (tests); the config only admits 1-65535.
  const size_t colon = listen.rfind(':');
  int port = -1;
  if (colon != std::string::npos) {
    host_ = listen.substr(0, colon);
    if (host_.size() >= 2 && host_.front() == '[') host_ = host_.substr(1, host_.size() - 2);
    try {
      port = std::stoi(listen.substr(colon + 1));
    } catch (...) {
    }
  }
  if (host_.empty() || port < 0 || port > 65535) {
    throw StartupError("metrics.listen '" + listen + "': expected host:port");
  }

  server_->Get("/metrics", [collectables](const httplib::Request&, httplib::Response& response) {
    response.set_content(render(collectables), "text/plain; version=0.0.4; charset=utf-8");
  });
  server_->Get("/healthz", [health](const httplib::Request&, httplib::Response& response) {
    const Health::Report report = health->report();
    response.status = report.healthy ? 200 : 503;
    response.set_content(report.text, "text/plain; charset=utf-8");
  });
  server_->Get("/", [](const httplib::Request&, httplib::Response& response) {
    response.set_content("dflashd: see /metrics and /healthz\n", "text/plain");
  });

  // httplib's default socket options include SO_REUSEPORT, with which a second daemon would
  // silently share the port with the first. Keep only SO_REUSEADDR (restart after a crash).
  server_->set_socket_options([](socket_t sock) {
    int yes = 1;
    setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  errno = 0;
  if (port == 0) {
    port_ = server_->bind_to_any_port(host_);
  } else {
    port_ = server_->bind_to_port(host_, port) ? port : -1;
  }
  if (port_ <= 0) {
    const int error = errno;
    std::string why = error == EADDRINUSE ? "address already in use (another dflashd, or another exporter, holds it)"
                      : error != 0        ? std::strerror(error)
                                          : "cannot bind (is the host an address of this machine?)";
    throw StartupError("metrics.listen " + listen + ": " + why);
  }
  thread_ = std::thread([this] { server_->listen_after_bind(); });
  // httplib's stop() does nothing until the accept loop has started (is_running()), so a
  // destructor racing the thread's start would join forever: wait for the loop here.
  for (int i = 0; i < 5000 && !server_->is_running(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  // The socket already listens (bind_to_port does listen()), so connections made before the
  // accept loop starts wait in the backlog: no start-up race for scrapers.
  log::info("metrics on http://{}:{}/metrics, health on /healthz", host_, port_);
}

HttpEndpoint::~HttpEndpoint() {
  server_->stop();
  if (thread_.joinable()) thread_.join();
}

}  // namespace dflash::daemon
