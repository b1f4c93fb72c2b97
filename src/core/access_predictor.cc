#include "layerstream/access_predictor.h"

#include "layerstream/check.h"

namespace layerstream {

AccessPredictor::AccessPredictor(std::size_t max_history) : max_history_(max_history) {
  LS_CHECK_ARG(max_history >= 4 * kMaxMatch, "AccessPredictor: keep at least ", 4 * kMaxMatch,
               " uses, got ", max_history);
}

void AccessPredictor::observe(std::uint64_t layer) {
  ++stats_.observed;
  const bool following = valid_ && cursor_ < history_.size() && history_[cursor_] == layer;
  if (valid_ && cursor_ < history_.size()) {
    ++stats_.predicted;
    if (following) ++stats_.correct;
  }
  history_.push_back(layer);
  if (history_.size() > max_history_) {
    const std::size_t dropped = history_.size() / 2;
    history_.erase(history_.begin(), history_.begin() + static_cast<std::ptrdiff_t>(dropped));
    rebuild_index();
    cursor_ = cursor_ >= dropped ? cursor_ - dropped : 0;
    if (cursor_ == 0) valid_ = false;
  }
  auto& seen = occurrences_[layer];
  if (following) {
    ++cursor_;  // still on the remembered track
  } else {
    reanchor();
  }
  seen.push_back(history_.size() - 1);
  if (seen.size() > kOccurrencesKept) seen.erase(seen.begin());
}

std::size_t AccessPredictor::match_length(std::size_t a, std::size_t b) const {
  std::size_t k = 1;
  for (; k <= kMaxMatch; ++k) {
    if (a < k) return kMaxMatch;  // reached the start of history: counts as agreeing
    if (b < k || history_[a - k] != history_[b - k]) break;
  }
  return k - 1;
}

void AccessPredictor::reanchor() {
  const std::size_t now = history_.size() - 1;
  const auto it = occurrences_.find(history_[now]);
  valid_ = false;
  if (it == occurrences_.end()) return;
  std::size_t best_length = 0;
  for (std::size_t p : it->second) {  // oldest first, so ties go to the most recent
    const std::size_t length = match_length(p, now);
    if (!valid_ || length >= best_length) {
      best_length = length;
      cursor_ = p + 1;
      valid_ = true;
    }
  }
}

std::vector<std::uint64_t> AccessPredictor::predict(std::size_t count) const {
  std::vector<std::uint64_t> next;
  if (!valid_) return next;
  for (std::size_t i = cursor_; i < history_.size() && next.size() < count; ++i) next.push_back(history_[i]);
  return next;
}

void AccessPredictor::rebuild_index() {
  occurrences_.clear();
  for (std::size_t i = 0; i < history_.size(); ++i) {
    auto& seen = occurrences_[history_[i]];
    seen.push_back(i);
    if (seen.size() > kOccurrencesKept) seen.erase(seen.begin());
  }
}

}  // namespace layerstream
