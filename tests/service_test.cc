// Tests of the daemon's service pieces without torch: the HTTP endpoint (metrics exposition,
// health), the systemd notify protocol against a stand-in socket, signal handling, and the
// logging facade.
#include <gtest/gtest.h>
#include <httplib.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include "common/health.h"
#include "common/log.h"
#include "daemon/http_endpoint.h"
#include "daemon/process_metrics.h"
#include "daemon/signals.h"
#include "daemon/systemd_notify.h"
#include "tests/test_util.h"

namespace dflash::daemon {
namespace {

std::vector<std::shared_ptr<prometheus::Collectable>> collectables(std::shared_ptr<prometheus::Registry> r) {
  return {r, std::make_shared<ProcessCollector>(),
          std::make_shared<BuildInfoCollector>(std::map<std::string, std::string>{{"version", "9.9.9"}})};
}

TEST(HttpEndpoint, ServesMetricsInPrometheusTextFormat) {
  auto registry = std::make_shared<prometheus::Registry>();
  auto& counter = prometheus::BuildCounter().Name("dflashd_test_tokens_total").Help("tokens").Register(*registry).Add({});
  counter.Increment(42);
  auto health = std::make_shared<Health>();
  HttpEndpoint endpoint("127.0.0.1:0", collectables(registry), health);
  ASSERT_GT(endpoint.port(), 0);

  httplib::Client client("127.0.0.1", endpoint.port());
  auto response = client.Get("/metrics");
  ASSERT_TRUE(response);
  EXPECT_EQ(response->status, 200);
  EXPECT_EQ(response->get_header_value("Content-Type"), "text/plain; version=0.0.4; charset=utf-8");
  const std::string& body = response->body;
  EXPECT_NE(body.find("# TYPE dflashd_test_tokens_total counter\ndflashd_test_tokens_total 42"), std::string::npos);
  EXPECT_NE(body.find("dflashd_build_info{version=\"9.9.9\"} 1"), std::string::npos);
  for (const char* name : {"process_cpu_seconds_total", "process_resident_memory_bytes", "process_start_time_seconds",
                           "process_open_fds", "process_threads", "process_virtual_memory_bytes"}) {
    EXPECT_NE(body.find(std::string("\n") + name + " "), std::string::npos) << name;
  }
  // Values change between scrapes: the exposition is computed per request.
  counter.Increment();
  EXPECT_NE(client.Get("/metrics")->body.find("dflashd_test_tokens_total 43"), std::string::npos);
}

TEST(HttpEndpoint, HealthzIs200WhenHealthyAnd503WithReasons) {
  auto health = std::make_shared<Health>();
  health->set_healthy("main");
  HttpEndpoint endpoint("127.0.0.1:0", collectables(std::make_shared<prometheus::Registry>()), health);
  httplib::Client client("127.0.0.1", endpoint.port());
  auto ok = client.Get("/healthz");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200);
  EXPECT_EQ(ok->body, "ok\n");

  health->set_unhealthy("drafter-0", "no heartbeat for 612 s");
  auto bad = client.Get("/healthz");
  ASSERT_TRUE(bad);
  EXPECT_EQ(bad->status, 503);
  EXPECT_EQ(bad->body, "drafter-0: no heartbeat for 612 s\n");

  health->set_healthy("drafter-0");
  EXPECT_EQ(client.Get("/healthz")->status, 200);
}

TEST(HttpEndpoint, PortInUseIsAClearStartupError) {
  auto health = std::make_shared<Health>();
  HttpEndpoint first("127.0.0.1:0", collectables(std::make_shared<prometheus::Registry>()), health);
  const std::string listen = "127.0.0.1:" + std::to_string(first.port());
  try {
    HttpEndpoint second(listen, collectables(std::make_shared<prometheus::Registry>()), health);
    FAIL() << "binding a taken port must throw";
  } catch (const StartupError& e) {
    EXPECT_EQ(std::string(e.what()), "metrics.listen " + listen +
                                         ": address already in use (another dflashd, or another exporter, holds it)");
  }
}

TEST(HttpEndpoint, MalformedListenAddress) {
  EXPECT_THROW(HttpEndpoint("nonsense", {}, std::make_shared<Health>()), StartupError);
}

TEST(SystemdNotify, NoSocketMeansNoOp) {
  ::unsetenv("NOTIFY_SOCKET");
  ::unsetenv("WATCHDOG_USEC");
  SystemdNotifier notifier;
  EXPECT_FALSE(notifier.enabled());
  EXPECT_TRUE(notifier.ready());
  EXPECT_FALSE(notifier.watchdog_interval().has_value());
}

TEST(SystemdNotify, SendsTheProtocolMessages) {
  test::NotifySocket socket;
  ::setenv("NOTIFY_SOCKET", socket.path().c_str(), 1);
  ::setenv("WATCHDOG_USEC", "3000000", 1);
  ::unsetenv("WATCHDOG_PID");
  SystemdNotifier notifier;
  ::unsetenv("NOTIFY_SOCKET");
  ::unsetenv("WATCHDOG_USEC");
  ASSERT_TRUE(notifier.enabled());
  ASSERT_TRUE(notifier.watchdog_interval().has_value());
  EXPECT_EQ(notifier.watchdog_interval()->count(), 1500000);  // half the limit

  EXPECT_TRUE(notifier.ready());
  EXPECT_EQ(socket.receive(), "READY=1\nSTATUS=running\nMAINPID=" + std::to_string(::getpid()));
  EXPECT_TRUE(notifier.status("training: step 10"));
  EXPECT_EQ(socket.receive(), "STATUS=training: step 10");
  EXPECT_TRUE(notifier.watchdog());
  EXPECT_EQ(socket.receive(), "WATCHDOG=1");
  EXPECT_TRUE(notifier.stopping());
  EXPECT_EQ(socket.receive(), "STOPPING=1\nSTATUS=stopping");
}

TEST(SystemdNotify, WatchdogForAnotherPidIsIgnored) {
  ::setenv("WATCHDOG_USEC", "3000000", 1);
  ::setenv("WATCHDOG_PID", "1", 1);
  SystemdNotifier notifier;
  ::unsetenv("WATCHDOG_USEC");
  ::unsetenv("WATCHDOG_PID");
  EXPECT_FALSE(notifier.watchdog_interval().has_value());
}

TEST(SystemdNotify, AbstractNamespaceSocket) {
  // '@name' is an abstract socket: bind one and check the datagram arrives.
  const std::string name = "dflashd-test-" + std::to_string(::getpid());
  const int fd = ::socket(AF_UNIX, SOCK_DGRAM, 0);
  sockaddr_un address{};
  address.sun_family = AF_UNIX;
  std::memcpy(address.sun_path + 1, name.data(), name.size());
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address),
                   static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + name.size())),
            0);
  ::setenv("NOTIFY_SOCKET", ("@" + name).c_str(), 1);
  SystemdNotifier notifier;
  ::unsetenv("NOTIFY_SOCKET");
  EXPECT_TRUE(notifier.ready());
  char buffer[256];
  pollfd p{fd, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 5000), 1);
  const ssize_t n = ::recv(fd, buffer, sizeof(buffer), 0);
  EXPECT_EQ(std::string(buffer, static_cast<size_t>(n)).rfind("READY=1\n", 0), 0u);
  ::close(fd);
}

// Signal tests run in a child process (gtest death tests fork), so the blocked mask and the
// exits do not touch the test runner.
TEST(SignalWatcher, FirstSignalRequestsStopSecondExitsAtOnce) {
  EXPECT_EXIT(
      {
        std::atomic<int> stops{0};
        SignalWatcher watcher([&](int) { stops++; }, [] {});
        ::kill(::getpid(), SIGTERM);
        for (int i = 0; i < 200 && !watcher.stop_requested(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        if (!watcher.stop_requested() || watcher.stop_signal() != SIGTERM || stops != 1) _exit(1);
        ::kill(::getpid(), SIGINT);  // the second signal: immediate exit with 128 + SIGINT
        std::this_thread::sleep_for(std::chrono::seconds(5));
        _exit(2);
      },
      ::testing::ExitedWithCode(128 + SIGINT), "second SIGINT: exiting at once");
}

TEST(SignalWatcher, SighupCallsReloadAndDoesNotStop) {
  EXPECT_EXIT(
      {
        std::atomic<int> reloads{0};
        SignalWatcher watcher([](int) {}, [&] { reloads++; });
        ::kill(::getpid(), SIGHUP);
        for (int i = 0; i < 200 && reloads == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        _exit(reloads == 1 && !watcher.stop_requested() ? 0 : 1);
      },
      ::testing::ExitedWithCode(0), "");
}

TEST(Log, FormatFillsPlaceholdersInOrder) {
  EXPECT_EQ(log::format("{} of {} tensors from {}", 3, 7, "a.safetensors"), "3 of 7 tensors from a.safetensors");
  EXPECT_EQ(log::format("no placeholders"), "no placeholders");
  EXPECT_EQ(log::format("{} {}", 1), "1 {}");  // a missing argument stays visible
}

TEST(Log, JsonLinesToAFileAndReopenAfterRotation) {
  const std::string dir = test::make_temp_dir("log");
  const std::string path = dir + "/dflashd.log";
  log::configure({log::Level::debug, /*json=*/true, path});
  log::info("hello \"{}\"\nline two", "world");
  log::debug("visible");
  log::trace("filtered out");
  log::flush();
  std::string text = test::read_file(path);
  EXPECT_NE(text.find(R"("level":"info","thread":)"), std::string::npos) << text;
  EXPECT_NE(text.find(R"("message":"hello \"world\"\nline two"})"), std::string::npos) << text;
  EXPECT_NE(text.find("visible"), std::string::npos);
  EXPECT_EQ(text.find("filtered out"), std::string::npos);

  // logrotate moves the file away; SIGHUP -> reopen() creates a fresh one.
  ASSERT_EQ(::rename(path.c_str(), (path + ".1").c_str()), 0);
  log::reopen();
  log::warn("after rotation");
  log::flush();
  EXPECT_NE(test::read_file(path).find("after rotation"), std::string::npos);
  EXPECT_EQ(test::read_file(path + ".1").find("after rotation"), std::string::npos);
  log::configure({});
}

TEST(Log, UnopenableFileIsAnErrorNamingIt) {
  try {
    // A path below a regular file can never be created (spdlog makes missing directories).
    log::configure({log::Level::info, false, "/etc/hostname/x.log"});
    FAIL();
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("logging.file /etc/hostname/x.log: cannot open"), std::string::npos);
  }
}

TEST(Log, ParseLevel) {
  log::Level level;
  EXPECT_TRUE(log::parse_level("warn", &level));
  EXPECT_EQ(level, log::Level::warn);
  EXPECT_FALSE(log::parse_level("loud", &level));
}

}  // namespace
}  // namespace dflash::daemon
