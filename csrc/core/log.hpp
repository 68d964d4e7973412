// Log lines of a cam group, to stderr. The level is the group's `log_level` option
// (TORCH_CAM_LOG_LEVEL): error < warn (default) < info (what the group chose at init) < debug
// (every op's issue and completion). A line is written with one write(2), so lines of
// concurrent ranks and threads never interleave.
#pragma once

#include <string>

namespace cam {

enum class LogLevel : int { kError = 0, kWarn, kInfo, kDebug };

// "error", "warn", "info" or "debug"; throws c10::Error naming the option for anything else.
LogLevel parse_log_level(const std::string& name);
const char* log_level_name(LogLevel l);

// "[torch_cam I 12:41:31.788123 pid 4242] <who>: <text>\n"
void log_line(LogLevel l, const std::string& who, const std::string& text);

}  // namespace cam
