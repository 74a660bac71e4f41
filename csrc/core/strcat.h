// Building error messages from parts (torch-free code has no c10::str).
#pragma once

#include <sstream>
#include <string>

namespace kvcache {

template <class... Parts>
std::string cat(const Parts&... parts) {
  std::ostringstream s;
  (s << ... << parts);
  return s.str();
}

}  // namespace kvcache
