// LlmDataDist: LinkLlmClusters, UnlinkLlmClusters and SetRole between two
// instances of one process over loopback.
#include <chrono>
#include <thread>

#include "test_support.h"

namespace dd_test {
namespace {

using namespace llm_datadist;

// One registered cache on each side; PushKvBlocks in both directions tells
// whether a link is usable.
class LinkTest : public LinkedPairTest {
 protected:
  void SetUp() override {
    LinkedPairTest::SetUp();
    if (HasFatalFailure()) return;
    ASSERT_STATUS(LLM_SUCCESS, server_cache_.RegisterWith(*server_));
    ASSERT_STATUS(LLM_SUCCESS, client_cache_.RegisterWith(*client_));
  }

  Status ClientPush() {
    return client_->PushKvBlocks(client_cache_.cache(), server_cache_.At(kServerId), {0}, {1});
  }
  Status ServerPush() {
    return server_->PushKvBlocks(server_cache_.cache(), client_cache_.At(kClientId), {2}, {3});
  }
  // Pushes the client's block 0 to the server's block 1, checking the
  // server's bytes; with `both_ways`, then the server's block 2 to the
  // client's block 3, checking the client's.
  void ExpectPushes(bool both_ways) {
    Bytes server_expected = server_cache_.Snapshot();
    ApplyUnits(server_expected, client_cache_.Snapshot(), 32, LayerPairs(0, 0, 1), 2, {0}, {1});
    ASSERT_STATUS(LLM_SUCCESS, ClientPush());
    EXPECT_TRUE(SameBytes(server_cache_.Snapshot(), server_expected));
    if (!both_ways) return;
    Bytes client_expected = client_cache_.Snapshot();
    ApplyUnits(client_expected, server_cache_.Snapshot(), 32, LayerPairs(0, 0, 1), 2, {2}, {3});
    ASSERT_STATUS(LLM_SUCCESS, ServerPush());
    EXPECT_TRUE(SameBytes(client_cache_.Snapshot(), client_expected));
  }

  HostCache server_cache_{2, 4, 32, 11};
  HostCache client_cache_{2, 4, 32, 22};
};

// The path each end reports once the link's first frame (the announcement
// that the initiator reaches the acceptor's memory) has been read.
std::string SettledTransport(const LlmDataDist &from, uint64_t peer, const std::string &want) {
  std::string path;
  for (int i = 0; i < 12000; ++i) {  // a minute at most
    if (from.GetLinkTransport(peer, path) == LLM_SUCCESS && path == want) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return path;
}

TEST_F(LinkTest, LinkedPairMovesDataBothWays) {
  // Two instances of one process share a host: kernel copies, both ways.
  std::string path;
  ASSERT_STATUS(LLM_SUCCESS, client_->GetLinkTransport(kServerId, path));
  EXPECT_EQ(path, "same_host");
  EXPECT_EQ(SettledTransport(*server_, kClientId, "same_host"), "same_host");
  EXPECT_STATUS(LLM_NOT_YET_LINK, client_->GetLinkTransport(kUnlinkedId, path));
  ExpectPushes(true);
}

// OPTION_TRANSPORT "tcp" on either end keeps the link's bytes on sockets.
class TcpLinkTest : public LinkTest {
 protected:
  Options ClientOptions() const override { return {{OPTION_TRANSPORT, "tcp"}}; }
};

TEST_F(TcpLinkTest, LinkedPairMovesDataBothWaysOverTcp) {
  std::string path;
  ASSERT_STATUS(LLM_SUCCESS, client_->GetLinkTransport(kServerId, path));
  EXPECT_EQ(path, "tcp");
  ASSERT_STATUS(LLM_SUCCESS, server_->GetLinkTransport(kClientId, path));
  EXPECT_EQ(path, "tcp");
  ExpectPushes(true);
}

// Every blocking call reads its own answers: with the sweep off, an answer
// the call did not read would wait for sync_kv_timeout and be read by the
// link ("link"), so the counts say exactly who read.
class NoSweepLinkTest : public LinkTest {
 protected:
  // Owner-served: one-sided pushes have no answers to read.
  Options ClientOptions() const override { return {{OPTION_ANSWER_SWEEP_MS, "0"}, {OPTION_ACCESS, "owner"}}; }
};

TEST_F(NoSweepLinkTest, BlockingPushesReadTheirOwnAnswers) {
  EXPECT_EQ(SettledTransport(*client_, kServerId, "same_host"), "same_host");
  const auto before = client_->GetAnswerCounts();
  ASSERT_EQ(before.size(), 5u);
  constexpr int kPushes = 20;
  for (int i = 0; i < kPushes; ++i) ASSERT_STATUS(LLM_SUCCESS, ClientPush());
  auto read = client_->GetAnswerCounts();
  for (auto &entry : read) entry.second -= before.at(entry.first);
  EXPECT_EQ(read["thread"] + read["look"], static_cast<uint64_t>(kPushes));
  EXPECT_EQ(read["sweep"], 0u);
  EXPECT_EQ(read["link"], 0u);
  EXPECT_EQ(read["drain"], 0u);
  ExpectPushes(false);
}

TEST(AnswerCounts, EmptyBeforeInitialize) {
  LlmDataDist datadist(7, LlmRole::kPrompt);
  EXPECT_TRUE(datadist.GetAnswerCounts().empty());
}

// A shared secret on both ends: the link proves it both ways and works.
class AuthLinkTest : public LinkTest {
 protected:
  Options ServerOptions() const override { return {{OPTION_AUTH_KEY, "open sesame"}}; }
  Options ClientOptions() const override { return {{OPTION_AUTH_KEY, "open sesame"}}; }
};

TEST_F(AuthLinkTest, MatchingSecretsLinkAndMoveData) { ExpectPushes(false); }

TEST_F(AuthLinkTest, AWrongOrMissingSecretIsAuthFailed) {
  for (const char *key : {"open barley", ""}) {
    LlmDataDist other(303, LlmRole::kPrompt);
    Options options = BaseOptions();
    if (*key != '\0') options[OPTION_AUTH_KEY] = key;
    ASSERT_STATUS(LLM_SUCCESS, other.Initialize(options));
    std::vector<Status> rets;
    EXPECT_STATUS(LLM_AUTH_FAILED, other.LinkLlmClusters({ServerInfo()}, rets, 2000)) << key;
  }
}

// Link encryption on both ends, over TCP: every connection in TLS 1.3, and
// GetLinkTransport says so on either end.
class EncryptedLinkTest : public LinkTest {
 protected:
  Options ServerOptions() const override {
    return {{OPTION_AUTH_KEY, "open sesame"}, {OPTION_LINK_ENCRYPTION, "tls"}, {OPTION_TRANSPORT, "tcp"}};
  }
  Options ClientOptions() const override { return ServerOptions(); }
};

TEST_F(EncryptedLinkTest, BothEndsSayTheLinkIsEncrypted) {
  ExpectPushes(true);  // every connection's handshake has ended at both ends
  for (auto [from, peer] : {std::make_pair(client_.get(), kServerId), std::make_pair(server_.get(), kClientId)}) {
    LlmDataDist::LinkTransportInfo info;
    ASSERT_STATUS(LLM_SUCCESS, from->GetLinkTransport(peer, info));
    EXPECT_EQ(info.transport, "tcp");
    EXPECT_TRUE(info.encrypted);
    EXPECT_EQ(info.cipher, "TLS_AES_128_GCM_SHA256");
  }
  LlmDataDist::LinkTransportInfo info;
  EXPECT_STATUS(LLM_NOT_YET_LINK, client_->GetLinkTransport(kUnlinkedId, info));
}

TEST_F(EncryptedLinkTest, APeerThatDoesNotEncryptIsRefused) {
  LlmDataDist other(303, LlmRole::kPrompt);
  Options options = BaseOptions();
  options[OPTION_AUTH_KEY] = "open sesame";
  options[OPTION_TRANSPORT] = "tcp";
  ASSERT_STATUS(LLM_SUCCESS, other.Initialize(options));
  std::vector<Status> rets;
  EXPECT_STATUS(LLM_LINK_FAILED, other.LinkLlmClusters({ServerInfo()}, rets, 2000));
}

TEST_F(TcpLinkTest, AnUnencryptedLinkSaysSo) {
  LlmDataDist::LinkTransportInfo info;
  ASSERT_STATUS(LLM_SUCCESS, client_->GetLinkTransport(kServerId, info));
  EXPECT_EQ(info.transport, "tcp");
  EXPECT_FALSE(info.encrypted);
  EXPECT_EQ(info.cipher, "");
  EXPECT_FALSE(info.kernel_tls);
}

TEST(LinkEncryption, TlsWithoutASecretOrWithUcxIsParamInvalid) {
  LlmDataDist other(303, LlmRole::kPrompt);
  Options options = BaseOptions();
  options[OPTION_LINK_ENCRYPTION] = "tls";
  EXPECT_STATUS(LLM_PARAM_INVALID, other.Initialize(options));
  options[OPTION_AUTH_KEY] = "open sesame";
  options[OPTION_TRANSPORT] = "ucx";
  EXPECT_STATUS(LLM_PARAM_INVALID, other.Initialize(options));
  options[OPTION_LINK_ENCRYPTION] = "on";
  options.erase(OPTION_TRANSPORT);
  EXPECT_STATUS(LLM_PARAM_INVALID, other.Initialize(options));
}

TEST_F(LinkTest, BadTransportOptionIsParamInvalid) {
  LlmDataDist other(303, LlmRole::kPrompt);
  EXPECT_STATUS(LLM_PARAM_INVALID, other.Initialize({{OPTION_TRANSPORT, "shm"}}));
}

TEST_F(LinkTest, SecondLinkIsAlreadyLink) {
  std::vector<Status> rets;
  EXPECT_STATUS(LLM_ALREADY_LINK, Link(rets));
  ASSERT_EQ(rets.size(), 1u);
  EXPECT_STATUS(LLM_ALREADY_LINK, rets[0]);
  // The first link is untouched.
  EXPECT_STATUS(LLM_SUCCESS, ClientPush());
  EXPECT_STATUS(LLM_SUCCESS, ServerPush());
}

TEST_F(LinkTest, LinkTimeoutMustBePositive) {
  LlmDataDist other(303, LlmRole::kDecoder);
  ASSERT_STATUS(LLM_SUCCESS, other.Initialize(BaseOptions()));
  for (int32_t timeout : {0, -1, -1000}) {
    std::vector<Status> rets;
    EXPECT_STATUS(LLM_PARAM_INVALID, other.LinkLlmClusters({ServerInfo()}, rets, timeout)) << timeout;
  }
  // Nothing was linked.
  HostCache mine(2, 4, 32, 3);
  ASSERT_STATUS(LLM_SUCCESS, mine.RegisterWith(other));
  EXPECT_STATUS(LLM_NOT_YET_LINK, other.PushKvBlocks(mine.cache(), server_cache_.At(kServerId), {0}, {1}));
}

// Links `other` with one ClusterInfo and expects LLM_PARAM_INVALID both as
// the result and in rets[0].
void ExpectRefusedCluster(LlmDataDist &other, const ClusterInfo &info, const std::string &what) {
  std::vector<Status> rets;
  EXPECT_STATUS(LLM_PARAM_INVALID, other.LinkLlmClusters({info}, rets, 1000)) << what;
  ASSERT_EQ(rets.size(), 1u) << what;
  EXPECT_STATUS(LLM_PARAM_INVALID, rets[0]) << what;
}

TEST_F(LinkTest, EmptyOrInvalidIpIsParamInvalid) {
  LlmDataDist other(303, LlmRole::kDecoder);
  ASSERT_STATUS(LLM_SUCCESS, other.Initialize(BaseOptions()));
  for (const std::string bad : {"", "abc", "300.1.2.3", "127.0.0", "127.0.0.1:80", "::1"}) {
    ExpectRefusedCluster(other, MakeClusterInfo(kServerId, port_, bad), "remote ip '" + bad + "'");
    ExpectRefusedCluster(other, MakeClusterInfo(kServerId, port_, "127.0.0.1", bad), "local ip '" + bad + "'");
  }
}

TEST_F(LinkTest, ExactlyOneRemoteIpIsRequired) {
  LlmDataDist other(303, LlmRole::kDecoder);
  ASSERT_STATUS(LLM_SUCCESS, other.Initialize(BaseOptions()));
  ClusterInfo none = ServerInfo();
  none.remote_ip_infos.clear();
  ExpectRefusedCluster(other, none, "no remote ip");
  ClusterInfo two = ServerInfo();
  two.remote_ip_infos.push_back(two.remote_ip_infos[0]);
  ExpectRefusedCluster(other, two, "two remote ips");
  // A good cluster still links afterwards.
  std::vector<Status> rets;
  EXPECT_STATUS(LLM_SUCCESS, other.LinkLlmClusters({ServerInfo()}, rets, 2000));
}

TEST_F(LinkTest, RetsArePerCluster) {
  // A second server, and one bad entry between the two good ones.
  LlmDataDist second(404, LlmRole::kPrompt);
  const uint16_t second_port = InitListening(second);
  ASSERT_NE(second_port, 0);
  LlmDataDist other(303, LlmRole::kDecoder);
  ASSERT_STATUS(LLM_SUCCESS, other.Initialize(BaseOptions()));
  ClusterInfo bad = MakeClusterInfo(505, port_);
  bad.remote_ip_infos.clear();
  std::vector<Status> rets;
  EXPECT_STATUS(LLM_PARAM_INVALID,
                other.LinkLlmClusters({ServerInfo(), bad, MakeClusterInfo(404, second_port)}, rets, 2000));
  ASSERT_EQ(rets.size(), 3u);
  EXPECT_STATUS(LLM_SUCCESS, rets[0]);
  EXPECT_STATUS(LLM_PARAM_INVALID, rets[1]);
  EXPECT_STATUS(LLM_SUCCESS, rets[2]);
  // Both good links work.
  HostCache mine(2, 4, 32, 3), theirs(2, 4, 32, 4);
  ASSERT_STATUS(LLM_SUCCESS, mine.RegisterWith(other));
  ASSERT_STATUS(LLM_SUCCESS, theirs.RegisterWith(second));
  EXPECT_STATUS(LLM_SUCCESS, other.PushKvBlocks(mine.cache(), server_cache_.At(kServerId), {0}, {0}));
  EXPECT_STATUS(LLM_SUCCESS, other.PushKvBlocks(mine.cache(), theirs.At(404), {1}, {1}));
  EXPECT_EQ(std::vector<uint8_t>(theirs.Slot(0, 1), theirs.Slot(0, 2)),
            std::vector<uint8_t>(mine.Slot(0, 1), mine.Slot(0, 2)));
}

TEST_F(LinkTest, LinkingTwoClustersInOneCallSucceeds) {
  LlmDataDist second(404, LlmRole::kPrompt);
  const uint16_t second_port = InitListening(second);
  ASSERT_NE(second_port, 0);
  LlmDataDist other(303, LlmRole::kDecoder);
  ASSERT_STATUS(LLM_SUCCESS, other.Initialize(BaseOptions()));
  std::vector<Status> rets;
  EXPECT_STATUS(LLM_SUCCESS, other.LinkLlmClusters({ServerInfo(), MakeClusterInfo(404, second_port)}, rets, 2000));
  ASSERT_EQ(rets.size(), 2u);
  EXPECT_STATUS(LLM_SUCCESS, rets[0]);
  EXPECT_STATUS(LLM_SUCCESS, rets[1]);
}

TEST_F(LinkTest, NobodyListeningIsLinkFailedOrTimeout) {
  const uint16_t closed = PickFreePort();
  ASSERT_NE(closed, 0);
  LlmDataDist other(303, LlmRole::kDecoder);
  ASSERT_STATUS(LLM_SUCCESS, other.Initialize(BaseOptions()));
  std::vector<Status> rets;
  const Status st = other.LinkLlmClusters({MakeClusterInfo(606, closed)}, rets, 500);
  EXPECT_TRUE(st == LLM_LINK_FAILED || st == LLM_TIMEOUT) << StatusName(st);
  ASSERT_EQ(rets.size(), 1u);
  EXPECT_STATUS(st, rets[0]);
}

TEST_F(LinkTest, WrongRemoteClusterIdIsLinkFailed) {
  LlmDataDist other(303, LlmRole::kDecoder);
  ASSERT_STATUS(LLM_SUCCESS, other.Initialize(BaseOptions()));
  std::vector<Status> rets;
  // The server at port_ is cluster kServerId, not 999.
  EXPECT_STATUS(LLM_LINK_FAILED, other.LinkLlmClusters({MakeClusterInfo(999, port_)}, rets, 2000));
  ASSERT_EQ(rets.size(), 1u);
  EXPECT_STATUS(LLM_LINK_FAILED, rets[0]);
}

TEST_F(LinkTest, UnlinkStopsTransfersOnBothEnds) {
  std::vector<Status> rets;
  ASSERT_STATUS(LLM_SUCCESS, Unlink(rets));
  ASSERT_EQ(rets.size(), 1u);
  EXPECT_STATUS(LLM_SUCCESS, rets[0]);
  const Bytes server_before = server_cache_.Snapshot();
  const Bytes client_before = client_cache_.Snapshot();
  EXPECT_STATUS(LLM_NOT_YET_LINK, ClientPush());
  EXPECT_STATUS(LLM_NOT_YET_LINK, ServerPush());
  EXPECT_STATUS(LLM_NOT_YET_LINK, client_->PushKvCache(client_cache_.cache(), server_cache_.At(kServerId)));
  EXPECT_STATUS(LLM_NOT_YET_LINK, client_->PullKvCache(server_cache_.At(kServerId), client_cache_.cache()));
  EXPECT_STATUS(LLM_NOT_YET_LINK,
                client_->PullKvBlocks(server_cache_.At(kServerId), client_cache_.cache(), {0}, {1}));
  EXPECT_TRUE(SameBytes(server_cache_.Snapshot(), server_before));
  EXPECT_TRUE(SameBytes(client_cache_.Snapshot(), client_before));
}

TEST_F(LinkTest, RelinkAfterUnlinkWorks) {
  std::vector<Status> rets;
  ASSERT_STATUS(LLM_SUCCESS, Unlink(rets));
  ASSERT_STATUS(LLM_SUCCESS, Link(rets));
  ASSERT_EQ(rets.size(), 1u);
  EXPECT_STATUS(LLM_SUCCESS, rets[0]);
  Bytes expected = server_cache_.Snapshot();
  ApplyUnits(expected, client_cache_.Snapshot(), 32, LayerPairs(0, 0, 1), 2, {0}, {1});
  EXPECT_STATUS(LLM_SUCCESS, ClientPush());
  EXPECT_TRUE(SameBytes(server_cache_.Snapshot(), expected));
  EXPECT_STATUS(LLM_SUCCESS, ServerPush());
}

TEST_F(LinkTest, UnlinkWhenNotLinkedFails) {
  std::vector<Status> rets;
  ASSERT_STATUS(LLM_SUCCESS, Unlink(rets));
  const Status st = Unlink(rets);
  EXPECT_TRUE(st == LLM_NOT_YET_LINK || st == LLM_UNLINK_FAILED) << StatusName(st);
  ASSERT_EQ(rets.size(), 1u);
  EXPECT_STATUS(st, rets[0]);
}

TEST_F(LinkTest, UnlinkTimeoutMustBePositive) {
  std::vector<Status> rets;
  EXPECT_STATUS(LLM_PARAM_INVALID, client_->UnlinkLlmClusters({ServerInfo()}, rets, 0));
  EXPECT_STATUS(LLM_PARAM_INVALID, client_->UnlinkLlmClusters({ServerInfo()}, rets, -1));
  // Still linked.
  EXPECT_STATUS(LLM_SUCCESS, ClientPush());
}

TEST_F(LinkTest, UnlinkNeedsOneRemoteIp) {
  ClusterInfo none = ServerInfo();
  none.remote_ip_infos.clear();
  std::vector<Status> rets;
  EXPECT_STATUS(LLM_PARAM_INVALID, client_->UnlinkLlmClusters({none}, rets, 1000));
  ASSERT_EQ(rets.size(), 1u);
  EXPECT_STATUS(LLM_PARAM_INVALID, rets[0]);
  EXPECT_STATUS(LLM_SUCCESS, ClientPush());
}

TEST_F(LinkTest, ForcedUnlinkDropsTheLocalEndAndAllowsRelink) {
  std::vector<Status> rets;
  ASSERT_STATUS(LLM_SUCCESS, client_->UnlinkLlmClusters({ServerInfo()}, rets, 1000, true));
  ASSERT_EQ(rets.size(), 1u);
  EXPECT_STATUS(LLM_SUCCESS, rets[0]);
  EXPECT_STATUS(LLM_NOT_YET_LINK, ClientPush());
  // The listening side replaces the link of a cluster that links again.
  ASSERT_STATUS(LLM_SUCCESS, Link(rets));
  EXPECT_STATUS(LLM_SUCCESS, ClientPush());
  EXPECT_STATUS(LLM_SUCCESS, ServerPush());
}

TEST_F(LinkTest, SetRoleWithLinksIsExistLink) {
  EXPECT_STATUS(LLM_EXIST_LINK, client_->SetRole(LlmRole::kPrompt));
  EXPECT_STATUS(LLM_EXIST_LINK, server_->SetRole(LlmRole::kDecoder));
  // The links survive.
  EXPECT_STATUS(LLM_SUCCESS, ClientPush());
  EXPECT_STATUS(LLM_SUCCESS, ServerPush());
}

TEST_F(LinkTest, SetRoleWithoutLinksSucceeds) {
  std::vector<Status> rets;
  ASSERT_STATUS(LLM_SUCCESS, Unlink(rets));
  EXPECT_STATUS(LLM_SUCCESS, client_->SetRole(LlmRole::kPrompt));
  EXPECT_STATUS(LLM_SUCCESS, client_->SetRole(LlmRole::kPrompt));  // the current role again
  EXPECT_STATUS(LLM_SUCCESS, client_->SetRole(LlmRole::kMix));
  // The client still links as before.
  ASSERT_STATUS(LLM_SUCCESS, Link(rets));
  EXPECT_STATUS(LLM_SUCCESS, ClientPush());
}

TEST_F(LinkTest, SetRoleInvalidRoleOrListenIsParamInvalid) {
  std::vector<Status> rets;
  ASSERT_STATUS(LLM_SUCCESS, Unlink(rets));
  EXPECT_STATUS(LLM_PARAM_INVALID, client_->SetRole(LlmRole::kEnd));
  EXPECT_STATUS(LLM_PARAM_INVALID, client_->SetRole(LlmRole::kPrompt, {{OPTION_LISTEN_IP_INFO, "127.0.0.1"}}));
  EXPECT_STATUS(LLM_PARAM_INVALID, client_->SetRole(LlmRole::kPrompt, {{OPTION_LISTEN_IP_INFO, "nope:1"}}));
}

TEST_F(LinkTest, SetRoleWithListenAddressMakesAServer) {
  std::vector<Status> rets;
  ASSERT_STATUS(LLM_SUCCESS, Unlink(rets));
  uint16_t client_port = 0;
  for (int attempt = 0; attempt < 20 && client_port == 0; ++attempt) {
    const uint16_t port = PickFreePort();
    if (client_->SetRole(LlmRole::kPrompt, {{OPTION_LISTEN_IP_INFO, "127.0.0.1:" + std::to_string(port)}}) ==
        LLM_SUCCESS) {
      client_port = port;
    }
  }
  ASSERT_NE(client_port, 0);
  // Now the former server links to the former client.
  EXPECT_STATUS(LLM_SUCCESS, server_->LinkLlmClusters({MakeClusterInfo(kClientId, client_port)}, rets, 2000));
  Bytes expected = client_cache_.Snapshot();
  ApplyUnits(expected, server_cache_.Snapshot(), 32, LayerPairs(0, 0, 1), 2, {2}, {3});
  EXPECT_STATUS(LLM_SUCCESS, ServerPush());
  EXPECT_TRUE(SameBytes(client_cache_.Snapshot(), expected));
}

TEST_F(LinkTest, SetRoleWithoutListenAddressStopsListening) {
  std::vector<Status> rets;
  ASSERT_STATUS(LLM_SUCCESS, Unlink(rets));
  ASSERT_STATUS(LLM_SUCCESS, server_->SetRole(LlmRole::kDecoder));
  const Status st = Link(rets);
  EXPECT_TRUE(st == LLM_LINK_FAILED || st == LLM_TIMEOUT) << StatusName(st);
}

TEST_F(LinkTest, LinkBeforeRegisteringRemoteCacheStillReachesIt) {
  // A cache the server registers after the link exists is reachable.
  HostCache late(2, 4, 32, 33);
  ASSERT_STATUS(LLM_SUCCESS, late.RegisterWith(*server_));
  Bytes expected = late.Snapshot();
  ApplyUnits(expected, client_cache_.Snapshot(), 32, LayerPairs(0, 0, 1), 2, {1}, {2});
  EXPECT_STATUS(LLM_SUCCESS, client_->PushKvBlocks(client_cache_.cache(), late.At(kServerId), {1}, {2}));
  EXPECT_TRUE(SameBytes(late.Snapshot(), expected));
}

}  // namespace
}  // namespace dd_test
